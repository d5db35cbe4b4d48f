"""Start a HiveTrain run: the swarm's bootstrap peer, monitor and validator.

    python coordinator/start.py --preset demo --host 127.0.0.1

It listens on a stable address (same port and peer ID across restarts), publishes the run's configuration for
joiners, and prints the command volunteers paste to join. Until Ctrl-C it watches the swarm (every peer's record and
hivemind's progress, into the metrics store and TensorBoard, and W&B with --wandb-project), holds a copy of the
shared state that it serves to joiners, validates that state every few swarm epochs, and keeps the best checkpoint
(a folder, or S3).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shlex
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Optional

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
                            " blocking)")
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


def status_line(snapshot, looked_seconds: float) -> str:
    """What the coordinator prints after each look at the swarm; how long the look took shows when the monitor starts
    to lag behind a large swarm. Peers in client mode are counted: when all are, the coordinator leads their rounds
    (hivetrain.roles.coordinator.relay, which says so once)."""
    looked = f" | looked in {looked_seconds:.2f} s"
    if not snapshot.alive_peers:
        return f"swarm epoch {snapshot.epoch} | waiting for peers{looked}"
    clients = f" ({snapshot.clients} in client mode)" if snapshot.clients else ""
    eta = f", next in ~{snapshot.eta_seconds:.0f} s" if snapshot.eta_seconds is not None else ""
    loss = f" | loss {snapshot.mean_loss:.3f}" if snapshot.mean_loss is not None else ""
    return (f"swarm epoch {snapshot.epoch} | {snapshot.alive_peers} peer{'s' if snapshot.alive_peers > 1 else ''}"
            f"{clients} | {snapshot.samples_per_second:.0f} samples/s | {snapshot.samples_accumulated}/"
            f"{snapshot.target_batch_size} samples toward the next epoch{eta}{loss}{looked}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["issue-token"], ["revoke-token"]):
        from hivetrain.roles.coordinator.tokens import TOKEN_COMMANDS

        return TOKEN_COMMANDS[argv[0]](argv[1:])
    args = parse_args(argv)
    from hivetrain import require_extra

    require_extra("coordinator", "boto3", "tensorboard")
    from hivetrain.swarm import run_role

    return run_role(partial(_run, args), farewell="Coordinator stopped.")


def _run(args: argparse.Namespace) -> int:
    import torch
    from botocore.exceptions import BotoCoreError, ClientError

    from hivetrain.checkpoint import CheckpointError
    from hivetrain.checkpoint_location import load_checkpoint, open_store
    from hivetrain.model import choose_device
    from hivetrain.datasets import DatasetUnavailable, validation_loader
    from hivetrain.metrics_store import MetricsWriter, StoreError
    from hivemind.utils.crypto import RSAPrivateKey

    from hivetrain.roles.coordinator.tokens import authority_path, revoked_holders
    from hivetrain.access import OWN_GRANT_LIFETIME, RunAuthorizer, issue_grant, load_key
    from hivetrain.hivemind_internals import identity_key, sign_records_with
    from hivetrain.reachability import serve_dial_back
    from hivetrain.run_record import guard_run_keys
    from hivetrain.swarm import DHTOptions, SwarmError, listen_maddr, one_line_per_event, start_dht

    if not args.verbose:
        one_line_per_event()

    # Everything that can be refused is checked before the run is touched: the checkpoint to resume, the store, the
    # validation data. Only then does the coordinator join the swarm.
    resources = []  # closed in reverse order on the way out
    try:
        config = run_config(args)
        resume = None
        if args.resume:
            resume = load_checkpoint(args.resume, endpoint_url=args.s3_endpoint_url)
            if resume.config.fingerprint != config.fingerprint:
                raise ValueError(
                    f"--resume {args.resume} is a checkpoint of run {resume.config.run_id!r} (preset"
                    f" {resume.config.preset!r}, fingerprint {resume.config.fingerprint}), not of this run"
                    f" ({config.run_id!r}, preset {config.preset!r}, fingerprint {config.fingerprint}): start with"
                    f" --preset {resume.config.preset} --run-id {resume.config.run_id}")
            print(f"Resuming from {args.resume}: swarm epoch {resume.epoch}", flush=True)
        if args.threads:
            torch.set_num_threads(args.threads)
        device = choose_device(args.device)
        log_dir = Path(args.log_dir or Path("runs") / config.run_id)
        writer = MetricsWriter(args.store or log_dir / "metrics.sqlite")
        resources.append(writer)
        loader = None
        if args.validate_every:
            loader = validation_loader(config, args.data_dir, val_limit=args.val_limit)
        checkpoints = open_store(args.checkpoint_store or log_dir / "checkpoints", keep_last=args.keep_last,
                                 endpoint_url=args.s3_endpoint_url)
        resources.append(checkpoints)
        metrics_server = None
        if args.metrics_port is not None:
            metrics_server = _serve_metrics(writer.path, args.metrics_host, args.metrics_port)
            resources.append(metrics_server)

        identity = Path(args.identity or Path.home() / ".cache" / "hivetrain" / config.run_id / "coordinator.key")
        identity.parent.mkdir(parents=True, exist_ok=True)
        # The run and rollback records are signed with the identity key: joiners believe only records signed by the
        # key whose hash is the peer ID in their join command (hivetrain.run_record), across restarts too.
        sign_records_with(identity_key(str(identity)))
        authorizer = None
        if args.require_token:  # the coordinator holds a grant of its own, for its own key, renewed as it runs out
            authority_file = authority_path(args.authority_key, config.run_id)
            authority = load_key(authority_file)
            own_key = RSAPrivateKey.process_wide()  # its identity key (sign_records_with above)
            grant = issue_grant(authority, "coordinator", OWN_GRANT_LIFETIME, holder=own_key, with_key=False)
            # refuses what the owner revoked from its first request on; its main loop watches for more (_serve)
            authorizer = RunAuthorizer(grant, holder=own_key, renew_with=authority,
                                       revoked=revoked_holders(authority_file))
        dht = start_dht(DHTOptions(
            host_maddrs=[listen_maddr(args.host, args.port)], announce_maddrs=args.announce,
            identity_path=str(identity), authorizer=authorizer,
        ))
        resources.append(dht)
        # Before anything is published or read: this node refuses records of the run's keys that no reader could use.
        guard_run_keys(dht, config.run_id)
        dht.run_coroutine(serve_dial_back)  # joiners ask whether the swarm can dial them (--client-mode auto)
        return _serve(args, config, dht, writer, checkpoints, loader, resume, device, log_dir, metrics_server,
                      authorizer)
    except (SwarmError, StoreError, CheckpointError, DatasetUnavailable, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (BotoCoreError, ClientError) as e:
        print(f"error: S3: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    finally:
        for resource in reversed(resources):
            _close(resource)


def _serve_metrics(store: Path, host: str, port: int):
    from hivetrain.roles.coordinator.metrics_api import MetricsServer

    try:
        return MetricsServer(store, host, port)
    except ImportError as e:
        raise ValueError(str(e)) from None
    except OSError as e:  # the port is taken, the address is not this machine's
        raise ValueError(f"cannot serve metrics on {host} port {port}: {e.strerror or e}") from None


def _close(resource) -> None:
    from hivetrain.checkpoint import CheckpointStore

    if isinstance(resource, CheckpointStore) and not resource.flush(timeout=30):
        print(f"Some checkpoints are not uploaded yet: they stay staged and upload when a coordinator on this machine"
              f" next uses {resource.uri}", flush=True)
    resource.shutdown() if hasattr(resource, "shutdown") else resource.close()


def _serve(args, config, dht, writer, checkpoints, loader, resume, device, log_dir, metrics_server,
           authorizer) -> int:
    import torch
    from torch.utils.tensorboard import SummaryWriter

    from hivetrain.roles.coordinator.state import make_state_holder
    from hivetrain.roles.coordinator.swarm_monitor import SwarmMonitor
    from hivetrain.roles.coordinator.tokens import RevocationWatch, authority_path
    from hivetrain.roles.coordinator.validator import Validator
    from hivetrain.clock import EPOCHS_AHEAD, publish_clock
    from hivetrain.diloco import rounds_description
    from hivetrain.events import EventLog
    from hivetrain.membership import check_callers, publish_membership
    from hivetrain.metrics_store import RunInfo
    from hivetrain.rollback import RollbackRecord, publish_rollback
    from hivetrain.run_record import RUN_RECORD_TTL, publish_run_config
    from hivetrain.swarm import INSTALLED_JOIN, join_command, raise_if_leaving, visible_addresses
    from hivetrain.wandb_run import WandbScalars, open_wandb_run

    addresses, loopback_only = visible_addresses(dht)
    command = join_command(addresses)
    print(f"Run {config.run_id}: preset {config.preset}, fingerprint {config.fingerprint},"
          f" peer ID {dht.peer_id.to_base58()}", flush=True)
    if config.swarm.mode == "diloco":
        print(f"Outer rounds: {rounds_description(config.swarm)}", flush=True)
    if config.swarm.robust_aggregation != "none":
        setting = (f"clip radius {config.swarm.clip_radius:g}" if config.swarm.robust_aggregation == "centered-clip"
                   else f"trim fraction {config.swarm.trim_fraction:g}")
        print(f"Robust aggregation: {config.swarm.robust_aggregation} ({setting}) in every all-reduce", flush=True)
    if loopback_only:
        print("Only loopback addresses exist: volunteers can join from this machine only"
              " (use --host 0.0.0.0, or --announce with your public address).", flush=True)
    print(f"To join, run:\n  {command}\nor, where HiveTrain is pip-installed rather than cloned:\n"
          f"  {join_command(addresses, program=INSTALLED_JOIN)}", flush=True)
    if args.package_source:  # a volunteer's machine has no clone: pip installs HiveTrain first
        print(f"Volunteers install HiveTrain first with\n  pip install {shlex.quote(args.package_source)}\n(in the"
              f" notebook, peers/volunteer.ipynb: HIVETRAIN_SOURCE = {args.package_source!r})", flush=True)
    events = EventLog(args.events)
    events("serving", run_id=config.run_id, initial_peers=addresses, metrics_url=metrics_server and metrics_server.url)
    if args.require_token:
        run_option = f" --run-id {config.run_id}" if args.run_id else ""
        print(f"Private run: each volunteer adds --token TOKEN, printed by\n  python coordinator/start.py issue-token"
              f" NAME --expires 7d{run_option}\n(revoke-token NAME{run_option} takes one back)", flush=True)
    # A coordinator restarted on its store goes on from the epoch it last counted: its signed clock lapses in the swarm
    # a minute after it stopped, and from 0 a lone peer's claim would never move the count (hivetrain.clock).
    counted_before = writer.last_counted_epoch(config.run_id) or 0
    writer.set_run(RunInfo(run_id=config.run_id, preset=config.preset, fingerprint=config.fingerprint,
                           config_json=config.to_json(), join_command=command,
                           coordinator_peer_id=dht.peer_id.to_base58(), started=time.time()))
    print(f"Metrics: {writer.path}; TensorBoard: {log_dir / 'tensorboard'}; checkpoints: {checkpoints.uri}", flush=True)
    if metrics_server is not None:
        print(f"Prometheus: {metrics_server.url}/metrics; JSON: {metrics_server.url}/api/state", flush=True)
    loggers = [SummaryWriter(str(log_dir / "tensorboard"))]
    wandb_run = open_wandb_run(args, log_dir, config.run_id, config.to_dict(), step_metric="swarm/epoch",
                               report=lambda line: print(line, flush=True))
    if wandb_run is not None:
        loggers.append(WandbScalars(wandb_run, step_metric="swarm/epoch"))
    if authorizer is not None:  # a private run: its averagers answer the run's members only (hivetrain.membership)
        check_callers(dht, config.run_id)
    holder = make_state_holder(dht, config, resume, device=torch.device(device), events=events)
    monitor = SwarmMonitor(dht, config, writer, loggers, start_epoch=max(holder.epoch, counted_before))
    # A state a volunteer serves is a claim like its progress records: bounded by the coordinator's own count.
    holder.bound_downloads(lambda: monitor.epoch + EPOCHS_AHEAD)
    stop = threading.Event()
    printing = threading.Lock()

    def say(line: str) -> None:
        # the validation thread's lines and the status lines: print writes a line and its newline separately
        with printing:
            print(line, flush=True)

    # the owner's revoke-token, taken in while the run goes on (hivetrain.roles.coordinator.tokens)
    revocations = (RevocationWatch(dht, config.run_id, authority_path(args.authority_key, config.run_id), report=say)
                   if args.require_token else None)
    validation = None
    rollbacks: list[RollbackRecord] = []  # the latest, refreshed with the run's configuration

    def roll_back(record: RollbackRecord) -> None:
        rollbacks[:] = [record]
        publish_rollback(dht, record)

    if loader is not None:
        validator = Validator(holder, loader, writer, checkpoints, every=args.validate_every, device=device,
                              swarm_epoch=lambda: monitor.latest.epoch if monitor.latest else 0,
                              loggers=loggers, report=say,
                              rollback_drop=args.rollback_drop, publish_rollback=roll_back,
                              last_peers_epoch=lambda: monitor.last_peers_epoch)
        validation = threading.Thread(target=validator.run, args=(stop,), name="validator", daemon=True)
    def held() -> Optional[int]:
        """The epoch of the state the holder holds, in the clock: only a coordinator that validates takes states."""
        if validation is None:
            return None
        return holder.epoch if holder.has_state else 0

    try:
        next_publish = next_refresh = 0.0
        published_held: Optional[int] = None
        refused, next_refusal_warning = 0, 0.0
        while True:
            now = time.monotonic()
            if now >= next_publish:
                # Refresh well before the record expires, so a joiner always finds it.
                if not publish_run_config(dht, config):
                    # hivemind answers for the node that replied last, and a node pinned by a hostile plain value
                    # under the run key refuses every store while the others take it: say so once a minute, not at
                    # every refresh for as long as the value lives.
                    refused += 1
                    if now >= next_refusal_warning:
                        logging.warning(f"A DHT node refused the run's configuration ({refused} time(s) in the last"
                                        f" minute; others may hold it); retrying")
                        refused, next_refusal_warning = 0, now + 60.0
                for record in list(rollbacks):  # peers that were away, or joined since, still see the latest
                    publish_rollback(dht, record)
                if authorizer is not None:  # the peers' averagers answer this coordinator's state holder
                    publish_membership(dht, config.run_id, authorizer)
                next_publish = now + RUN_RECORD_TTL / 3
            if revocations is not None:
                revocations.poll()
            if now >= next_refresh:
                look_started = time.perf_counter()
                snapshot = monitor.refresh()
                # the bound on what the peers may claim, and the state this coordinator holds
                published_held = held()
                publish_clock(dht, config.run_id, snapshot.epoch, published_held)
                looked = time.perf_counter() - look_started
                say(status_line(snapshot, looked))
                events("look", epoch=snapshot.epoch, seconds=looked, states_served=holder.states_served)
                if validation is not None and validation.ident is None:
                    validation.start()  # after the first look: it needs to know where the swarm is
                next_refresh = now + args.refresh
            elif monitor.latest is not None and held() != published_held:
                # a last peer waits for this to leave (hivetrain.hand_over): at once, not at the next look
                published_held = held()
                publish_clock(dht, config.run_id, monitor.latest.epoch, published_held)
            time.sleep(0.2)
            raise_if_leaving()
    finally:
        stop.set()
        if validation is not None and validation.is_alive():
            validation.join(timeout=60)  # a validation in progress finishes and saves its checkpoint
        holder.shutdown()
        for scalars in loggers:
            scalars.close()


if __name__ == "__main__":
    sys.exit(main())
