"""The coordinator's command line: its options (docs/cli.md is written from them), their checks, and the run
configuration they make of a preset."""

from __future__ import annotations

import argparse
import dataclasses

DEFAULT_PORT = 31337


def build_parser() -> argparse.ArgumentParser:
    """The coordinator's options (docs/cli.md is written from them: scripts/cli_reference.py)."""
    from hivetrain.config import COMPRESSIONS, DEFAULT_PRESET, PRESETS, ROBUST_AGGREGATIONS, SWARM_MODES
    from hivetrain.wandb_run import add_wandb_arguments

    parser = argparse.ArgumentParser(
        prog="python coordinator/start.py",
        description="Start a HiveTrain run and keep its swarm together: bootstrap peer, monitor and validator.",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default=DEFAULT_PRESET,
                        help="what the run trains (default: %(default)s, the mission: ViT-B/32 on CIFAR-10); demo: a"
                             " tiny ViT at 32 px on scikit-learn's 8x8 digits; digits-vit-tiny: timm's ViT-Tiny at 32"
                             " px on digits (the throughput benchmark's model); digits-vit-b32: ViT-B/32's full state"
                             " on 32 px digits (join and transfer benchmarks on CPUs); synthetic-vit-b32: the mission"
                             " exactly, on seeded CIFAR-10-shaped noise from random weights or --pretrained-weights"
                             " FILE (nothing to download: GPU machines offline; measures speed, not accuracy)")
    parser.add_argument("--run-id", help="name of the run (default: the preset's); no '.' or '/'")
    parser.add_argument("--resume", default=None, metavar="PATH|s3://...",
                        help="start from a checkpoint (a .tar, a checkpoint folder or s3://bucket/prefix: its best):"
                             " joiners download its state; it must come from a run with the same --preset and --run-id")
    net = parser.add_argument_group("network")
    net.add_argument("--host", default="0.0.0.0", help="address to listen on (default: %(default)s; 127.0.0.1: this machine only)")
    net.add_argument("--port", type=int, default=DEFAULT_PORT, help="TCP port to listen on; keep it stable (default: %(default)s; 0: any free port)")
    net.add_argument("--announce", nargs="+", default=[], metavar="MULTIADDR",
                     help="addresses volunteers should dial instead of the listening ones (public IP, port"
                          " forwarding), e.g. /ip4/203.0.113.7/tcp/31337")
    net.add_argument("--identity", default=None, metavar="FILE",
                     help="private key file that keeps the peer ID stable (default:"
                          " ~/.cache/hivetrain/<run-id>/coordinator.key; created on first start). It also signs the"
                          " run and rollback records: the peer ID in the join command pins it, so keep it safe")
    net.add_argument("--require-token", action="store_true",
                     help="private run: only peers with a token from `issue-token` may join (see --authority-key;"
                          " `revoke-token` takes one back)")
    net.add_argument("--authority-key", default=None, metavar="FILE",
                     help="the key that signs the run's tokens (default: ~/.cache/hivetrain/<run-id>/authority.key;"
                          " created on first use)")
    net.add_argument("--package-source", default=None, metavar="PIP_SOURCE",
                     help="where volunteers install HiveTrain from: a git+https:// address, a wheel's URL or path, or a"
                          " package name; printed as a pip line and as the notebook's HIVETRAIN_SOURCE beside the"
                          " join command")
    swarm = parser.add_argument_group("swarm settings (published to every peer; default: the preset's)")
    swarm.add_argument("--mode", choices=SWARM_MODES, default=None,
                       help="sync: gradients averaged every swarm step; diloco: each peer takes --inner-steps steps of"
                            " its own optimizer, then the peers average the pseudo-gradient and take one outer step")
    swarm.add_argument("--inner-steps", type=int, default=None, metavar="H",
                       help="diloco: local steps per peer between outer rounds")
    swarm.add_argument("--overlap-rounds", action=argparse.BooleanOptionalAction, default=None,
                       help="diloco: run each outer round in the background while the peers take the next round's"
                            " inner steps; --no-overlap-rounds stops training for every round (default: the preset's,"
                            " overlapped)")
    swarm.add_argument("--round-seconds", type=float, default=None, metavar="S",
                       help="diloco: a round every S seconds of the clock (one grid for all peers) instead of every"
                            " --inner-steps steps; each peer takes as many inner steps as its device fits in S s and"
                            " looks for its group ahead of the round (H then only paces the inner LR schedule)")
    swarm.add_argument("--outer-lr", type=float, default=None, help="diloco: the outer SGD's learning rate")
    swarm.add_argument("--outer-momentum", type=float, default=None,
                       help="diloco: the outer SGD's Nesterov momentum (0: plain SGD)")
    swarm.add_argument("--target-batch-size", type=int, default=None, metavar="N",
                       help="sync: samples the swarm accumulates per optimizer step (one swarm epoch)")
    swarm.add_argument("--matchmaking-time", type=float, default=None, metavar="S",
                       help="seconds a peer waits for others to form an averaging group")
    swarm.add_argument("--target-group-size", type=int, default=None, metavar="G",
                       help="average in groups of at most G peers, formed anew every round (Moshpit), instead of one"
                            " group of every peer; either mode (see docs/run.md on picking G)")
    swarm.add_argument("--grad-compression", choices=COMPRESSIONS, default=None,
                       help="how gradients travel when peers average them")
    swarm.add_argument("--state-compression", choices=COMPRESSIONS, default=None,
                       help="how parameters and optimizer state travel (averaging and joiners' downloads)")
    swarm.add_argument("--average-state-every", type=int, default=None, metavar="EPOCHS",
                       help="swarm epochs between parameter and optimizer-state averaging rounds")
    swarm.add_argument("--robust-aggregation", choices=ROBUST_AGGREGATIONS, default=None,
                       help="how each part of an all-reduce combines the peers' copies: none (hivemind's weighted"
                            " mean, which one malicious peer can ruin), centered-clip or trimmed-mean")
    swarm.add_argument("--clip-radius", type=float, default=None, metavar="R",
                       help="centered-clip: the clipping radius, in median distances of the peers' copies of a part"
                            " from their coordinate-wise median")
    swarm.add_argument("--trim-fraction", type=float, default=None, metavar="F",
                       help="trimmed-mean: the share of peers' values dropped at each end of every coordinate")
    schedule = parser.add_argument_group("learning-rate schedule (published to every peer; default: the preset's)")
    schedule.add_argument("--warmup-steps", type=int, default=None, metavar="N",
                          help="optimizer steps of linear warmup: swarm epochs (sync) or a peer's inner steps (diloco)")
    schedule.add_argument("--total-steps", type=int, default=None, metavar="N",
                          help="optimizer steps after which the cosine schedule reaches its floor, counted the same way")
    watch = parser.add_argument_group("monitoring and validation")
    watch.add_argument("--verbose", action="store_true",
                       help="keep the tracebacks hivemind logs for the swarm's ordinary events (a peer that left"
                            " mid-download, a round without a group): one line per event otherwise")
    watch.add_argument("--refresh", type=float, default=10.0, help="seconds between looks at the swarm (default: %(default)s)")
    watch.add_argument("--log-dir", default=None, metavar="DIR",
                       help="where the metrics store, TensorBoard events and checkpoints go (default: runs/<run-id>)")
    watch.add_argument("--store", default=None, metavar="FILE", help="the SQLite metrics store (default: <log-dir>/metrics.sqlite)")
    watch.add_argument("--events", default=None, metavar="FILE",
                       help="append what happens (serving at which addresses and metrics URL, each look at the"
                            " swarm) as JSON lines, for benchmarks and tests")
    watch.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                       help="serve /metrics (Prometheus) and /api/state (JSON) on this port (default: off; 0: any"
                            " free port, printed)")
    watch.add_argument("--metrics-host", default="127.0.0.1",
                       help="address /metrics and /api/state listen on (default: %(default)s, this machine only)")
    watch.add_argument("--validate-every", type=int, default=1, metavar="EPOCHS",
                       help="validate the shared model every this many swarm epochs (default: %(default)s; 0: never)")
    watch.add_argument("--rollback-drop", type=float, default=None, metavar="POINTS",
                       help="when a validation's top-1 is more than POINTS percentage points below the best, or its"
                            " loss is not finite, send the swarm back to the best checkpoint's state (default: off)")
    watch.add_argument("--val-limit", type=int, default=None, metavar="N", help="validate on the first N samples only (small machines)")
    watch.add_argument("--data-dir", default=None, help="where datasets are stored (default: ~/.cache/hivetrain/data)")
    watch.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                       help="where to validate; auto (default): cuda when a GPU is present")
    watch.add_argument("--threads", type=int, default=None, help="CPU threads for validation (default: torch's choice)")
    ckpt = parser.add_argument_group("checkpoints")
    ckpt.add_argument("--checkpoint-store", default=None, metavar="DIR|s3://BUCKET/PREFIX",
                      help="where the best checkpoints go (default: <log-dir>/checkpoints); S3 credentials come from"
                           " the standard AWS chain (environment, ~/.aws, instance profile)")
    ckpt.add_argument("--s3-endpoint-url", default=None, help="an S3-compatible server's URL (MinIO, SeaweedFS, ...)")
    ckpt.add_argument("--keep-last", type=int, default=5, help="checkpoints kept besides the best (default: %(default)s)")
    add_wandb_arguments(parser)  # swarm metrics, validation and the best checkpoint, also to W&B
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from hivetrain.config import MAX_ROUND_SECONDS, MIN_ROUND_SECONDS

    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error("--port must be in 0..65535")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        parser.error("--metrics-port must be in 0..65535")
    if args.refresh <= 0:
        parser.error("--refresh must be positive")
    if args.validate_every < 0:
        parser.error("--validate-every must be 0 or more")
    if args.rollback_drop is not None and not 0 < args.rollback_drop <= 100:
        parser.error("--rollback-drop must be in (0, 100]")
    if args.rollback_drop is not None and args.validate_every == 0:
        parser.error("--rollback-drop needs validation (--validate-every 1 or more)")
    if args.val_limit is not None and args.val_limit < 1:
        parser.error("--val-limit must be at least 1")
    if args.keep_last < 0:
        parser.error("--keep-last must be 0 or more")
    if args.target_batch_size is not None and args.target_batch_size < 1:
        parser.error("--target-batch-size must be at least 1")
    if args.average_state_every is not None and args.average_state_every < 1:
        parser.error("--average-state-every must be at least 1")
    if args.inner_steps is not None and args.inner_steps < 1:
        parser.error("--inner-steps must be at least 1")
    if args.round_seconds is not None and not MIN_ROUND_SECONDS <= args.round_seconds <= MAX_ROUND_SECONDS:
        parser.error(f"--round-seconds must be from {MIN_ROUND_SECONDS:g} to {MAX_ROUND_SECONDS:g}")
    if args.outer_lr is not None and args.outer_lr <= 0:
        parser.error("--outer-lr must be positive")
    if args.outer_momentum is not None and not 0 <= args.outer_momentum < 1:
        parser.error("--outer-momentum must be in [0, 1)")
    if args.clip_radius is not None and not args.clip_radius > 0:
        parser.error("--clip-radius must be positive")
    if args.trim_fraction is not None and not 0 < args.trim_fraction < 0.5:
        parser.error("--trim-fraction must be in (0, 0.5)")
    if args.target_group_size is not None and args.target_group_size < 2:
        parser.error("--target-group-size must be at least 2")
    if args.matchmaking_time is not None and args.matchmaking_time <= 0:
        parser.error("--matchmaking-time must be positive")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        parser.error("--warmup-steps must be 0 or more")
    if args.total_steps is not None and args.total_steps < 1:
        parser.error("--total-steps must be at least 1")
    return args


def run_config(args: argparse.Namespace):
    """The preset, renamed and with the swarm and schedule settings given on the command line."""
    from hivetrain.config import get_preset

    config = get_preset(args.preset)
    if args.run_id:
        config = config.replace(run_id=args.run_id)
    overrides = dict(target_batch_size=args.target_batch_size, matchmaking_time=args.matchmaking_time,
                     grad_compression=args.grad_compression, state_compression=args.state_compression,
                     average_state_every=args.average_state_every, mode=args.mode, inner_steps=args.inner_steps,
                     overlap_rounds=args.overlap_rounds, round_seconds=args.round_seconds,
                     outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
                     robust_aggregation=args.robust_aggregation, clip_radius=args.clip_radius,
                     trim_fraction=args.trim_fraction, target_group_size=args.target_group_size)
    overrides = {key: value for key, value in overrides.items() if value is not None}
    if overrides.get("target_batch_size", config.batch_size) < config.batch_size:
        raise ValueError(f"--target-batch-size {args.target_batch_size} is below the run's per-step batch"
                         f" ({config.batch_size}): one local step would already overshoot a swarm epoch")
    if overrides:
        config = config.replace(swarm=dataclasses.replace(config.swarm, **overrides))
    schedule = {key: value for key, value in dict(warmup_steps=args.warmup_steps, total_steps=args.total_steps).items()
                if value is not None}
    return config.replace(optim=dataclasses.replace(config.optim, **schedule)) if schedule else config
