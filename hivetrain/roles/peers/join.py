"""Join a HiveTrain run as a volunteer peer.

    python peers/join.py --initial-peers /ip4/203.0.113.7/tcp/31337/p2p/Qm...

The peer fetches the run's configuration from the swarm, builds the model and data it describes, and trains with
the others until you press Ctrl-C (or a --max-* limit is reached).

With --devices N (diloco runs) the peer trains on N devices of this machine with DDP and is still one peer: this
process (rank 0) talks to the swarm, and Lightning starts the other ranks by running this same command again with
LOCAL_RANK set; they get what they need from rank 0 through RANK_SETUP_ENV and never touch the swarm.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import os
import sys
import threading
import time
from functools import partial
from pathlib import Path

# Imports of torch, lightning and hivemind take seconds: they come after the arguments are checked.

# Set by rank 0 of a peer on several devices before Lightning launches the other ranks (they inherit its environment):
# the run's configuration and the peer's data seed, as JSON.
RANK_SETUP_ENV = "HIVETRAIN_PEER_RANK_SETUP"
OTHER_RANKS_EXIT_TIMEOUT = 60.0  # seconds rank 0 waits for the other ranks to finish after training
GPU_LOADER_WORKERS = 2  # DataLoader processes of a peer on a GPU: prefetch while the card computes


def build_parser() -> argparse.ArgumentParser:
    """A volunteer's options (docs/cli.md is written from them: scripts/cli_reference.py)."""
    parser = argparse.ArgumentParser(
        prog="python peers/join.py",
        description="Join a HiveTrain run as a volunteer: fetch its configuration from the swarm and train with it.",
    )
    net = parser.add_argument_group("swarm")
    net.add_argument("--initial-peers", nargs="+", default=[], metavar="MULTIADDR",
                     help="addresses of peers already in the run, as printed by the coordinator"
                          " (default: $HIVETRAIN_INITIAL_PEERS)")
    net.add_argument("--run-id", help="the run to join when the swarm holds several")
    net.add_argument("--coordinator", default=None, metavar="PEER_ID",
                     help="the coordinator's peer ID (the /p2p/ part of its address), whose signature vouches for the"
                          " run; needed only when the initial peers are other volunteers (default: their peer IDs)")
    net.add_argument("--any-coordinator", action="store_true",
                     help="take the run record of whoever signed it (unsafe in a public swarm: anyone can publish one)")
    net.add_argument("--preset", help="refuse to join unless the run's configuration is exactly this preset")
    net.add_argument("--client-mode", choices=("auto", "on", "off"), default="auto",
                     help="on: only dial out (behind NAT or a firewall); auto (default): on unless the coordinator"
                          " can dial this machine back")
    net.add_argument("--host", default="0.0.0.0", help="address to listen on (default: %(default)s; not used in client mode)")
    net.add_argument("--port", type=int, default=0, help="TCP port to listen on (0: any free port)")
    net.add_argument("--announce", nargs="+", default=[], metavar="MULTIADDR",
                     help="addresses to announce instead of the listening ones (port forwarding, public IP)")
    net.add_argument("--token", default=None,
                     help="your access token for a private run, from the coordinator's issue-token (default:"
                          " $HIVETRAIN_TOKEN)")
    net.add_argument("--identity", help="private key file: keeps this peer's ID across restarts")
    net.add_argument("--auto-relay", action="store_true",
                     help="behind NAT, look for libp2p relays among the peers to become reachable through them")
    net.add_argument("--config-timeout", type=float, default=30.0,
                     help="seconds to wait for the run's configuration (default: %(default)s)")
    train = parser.add_argument_group("training")
    train.add_argument("--name", default=None,
                       help="your display name, shown to every peer and on the dashboard (default: peer- and the end"
                            " of this peer's ID; never the host name)")
    train.add_argument("--batch-size", type=_batch_size,
                       help="samples per local step, or auto: the largest that fits on this GPU, accumulated to the"
                            " run's batch when smaller (default: auto on a GPU, the run's batch on a CPU)")
    train.add_argument("--memory-budget", default=None, metavar="SIZE",
                       help="with --batch-size auto: memory a batch may use, e.g. 12GiB (default: 90%% of the GPU's;"
                            " on a CPU required: the peak RSS of training, the dataset aside)")
    train.add_argument("--precision", choices=("auto", "32", "bf16-mixed", "16-mixed"), default=None,
                       help="default: the run's; auto picks bf16/fp16 mixed precision on GPUs and 32 on CPUs")
    train.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                       help="auto (default): cuda when a GPU is present, else cpu")
    train.add_argument("--devices", type=int, default=1, metavar="N",
                       help="train on N devices of this machine with DDP (N GPUs, or N CPU processes), as one peer;"
                            " diloco runs only (default: 1)")
    train.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    train.add_argument("--data-dir", default=None, help="where datasets are stored (default: ~/.cache/hivetrain/data)")
    train.add_argument("--pretrained-weights", default=None, metavar="FILE",
                       help="load the run's pretrained weights from this file instead of the Hugging Face hub")
    train.add_argument("--seed", type=int, default=None, help="data order seed (default: a fresh one per peer)")
    train.add_argument("--compile", action="store_true",
                       help="compile the model with torch.compile (minutes at the first step, then faster steps)")
    stop = parser.add_argument_group("when to stop (default: on Ctrl-C)")
    stop.add_argument("--max-steps", type=int, default=-1, help="local steps (default: no limit)")
    stop.add_argument("--max-time", type=float, default=None, help="minutes")
    train.add_argument("--min-peers", type=int, default=1,
                       help="wait until this many peers (this one included) have joined before the first step")
    stop.add_argument("--stop-at-epoch", type=int, default=None,
                      help="leave once the swarm has reached this epoch (one epoch = one swarm optimizer step)")
    out = parser.add_argument_group("output")
    out.add_argument("--save-weights", default=None, metavar="FILE",
                     help="write the final weights (safetensors) when leaving")
    out.add_argument("--events", default=None, metavar="FILE",
                     help="append what happens (state loaded, each swarm epoch, leaving) as JSON lines, for"
                          " benchmarks and tests")
    out.add_argument("--progress-bar", choices=("auto", "on", "off"), default="auto",
                     help="auto (default): only when the output is a terminal")
    out.add_argument("--verbose", action="store_true",
                     help="show hivemind's own progress messages, and the tracebacks of the swarm's ordinary events"
                          " (a round without a group, a peer that left): one line per event otherwise")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.memory_budget is not None:
        from hivetrain.batch_size import parse_bytes  # no torch: cheap to check before the slow imports

        try:
            args.memory_budget = parse_bytes(args.memory_budget)
        except ValueError as e:
            parser.error(f"--memory-budget: {e}")
    if args.devices < 1:
        parser.error("--devices must be at least 1")
    if args.port < 0 or args.port > 65535:
        parser.error("--port must be in 0..65535")
    return args


def _batch_size(text: str) -> int | str:
    """--batch-size: "auto" or a number of samples, at least 1."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither auto nor a number of samples") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _is_local_swarm(initial_peers: list[str]) -> bool:
    hosts = [part for addr in initial_peers for part in addr.split("/")[2:3]]
    return all(_is_loopback_host(host) for host in hosts)


def _is_loopback_host(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def choose_client_mode(mode: str, initial_peers: list[str], host: str, port: int, announce: list[str],
                       authorizer=None) -> bool:
    """auto: a full peer when the coordinator can dial this machine back (the address it listens or announces on),
    client mode otherwise: behind NAT or a firewall a peer can only dial out. `authorizer`: this peer's grant in a
    private run, whose coordinator dials back only a grant's holder."""
    if mode != "auto":
        return mode == "on"
    if _is_local_swarm(initial_peers):
        return False  # the whole swarm is on this machine
    from hivetrain.reachability import check_reachability
    from hivetrain.swarm import listen_maddr

    print("Checking whether the swarm can dial this machine...", flush=True)
    result = check_reachability(initial_peers, [listen_maddr(host, port)], announce, authorizer=authorizer)
    if result.reachable is None:
        print(f"Reachability unknown: {result.detail}. Joining in client mode.", flush=True)
        return True
    if result.reachable:
        print(f"Reachable: {result.detail}.", flush=True)
        return False
    print(f"Not reachable: {result.detail}. Joining in client mode (dialling out only); forward a port and pass"
          f" --port/--announce to serve the swarm.", flush=True)
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank_setup = os.environ.get(RANK_SETUP_ENV)
    if rank_setup is not None and os.environ.get("LOCAL_RANK", "0") != "0":
        return _train_as_other_rank(args, rank_setup)
    from hivetrain.swarm import run_role

    return run_role(partial(_join, args), farewell="Left the swarm.")


def _train_as_other_rank(args: argparse.Namespace, rank_setup: str) -> int:
    """A rank that rank 0 of this peer launched: it trains its share of each inner step and never touches the swarm
    (no DHT, no records, no console lines); the run's configuration and the data seed came from rank 0."""
    import logging
    import signal

    import lightning.pytorch  # noqa: F401  (sets its loggers' levels on import: quieten them after it)

    from hivetrain.config import RunConfig

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("lightning.pytorch", "lightning.fabric"):  # rank 0 already says what Lightning is doing
        logging.getLogger(name).setLevel(logging.WARNING)
    # The peer leaves through rank 0: it says goodbye to the swarm and stops the other ranks (DiLoCoDDPStrategy.
    # on_exception). Ctrl-C reaches every process of the terminal's group, and a rank that stopped on its own would
    # break rank 0's collective mid-step (a gloo error instead of a goodbye).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    handed = json.loads(rank_setup)
    return _train(args, None, RunConfig.from_dict(handed["config"]), client_mode=False, data_seed=handed["data_seed"],
                  batch=handed["batch"])


def _join(args: argparse.Namespace) -> int:
    from hivetrain.access import TOKEN_ENV, AccessGrant, RunAuthorizer
    from hivetrain.config import get_preset
    from hivetrain.membership import MembershipPublisher, check_callers, publish_membership
    from hivetrain.revocation import RevocationWatcher
    from hivetrain.run_record import fetch_run
    from hivetrain.swarm import (
        DHTOptions, StayConnected, SwarmError, listen_maddr, one_line_per_event, resolve_initial_peers, start_dht,
    )

    if not args.verbose:
        one_line_per_event()

    try:
        initial_peers = resolve_initial_peers(args.initial_peers)
        if not initial_peers:
            raise SwarmError("no initial peers: pass --initial-peers (printed by the coordinator) or set"
                             " HIVETRAIN_INITIAL_PEERS")
        expected = get_preset(args.preset) if args.preset else None
        authorizer = None
        token = args.token or os.environ.get(TOKEN_ENV)
        if token:
            grant = AccessGrant.decode(token)
            if grant.expired:
                raise SwarmError(f"your token (for {grant.name}) expired on {time.ctime(grant.expires)}: ask the"
                                 f" coordinator for a new one")
            authorizer = RunAuthorizer(grant)
            args.name = args.name or grant.name
        client_mode = choose_client_mode(args.client_mode, initial_peers, args.host, args.port, args.announce,
                                         authorizer)
    except (SwarmError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    network = DHTOptions(
        initial_peers=initial_peers,
        host_maddrs=[listen_maddr(args.host, args.port)],
        announce_maddrs=args.announce,
        identity_path=args.identity,
        client_mode=client_mode,
        use_auto_relay=args.auto_relay,
        authorizer=authorizer,
    )
    dht = revocations = membership = None
    training_stack = threading.Thread(target=_import_training_stack, name="import-training-stack", daemon=True)
    try:
        dht = start_dht(network, while_connecting=training_stack.start)
        StayConnected(dht, initial_peers).start()  # a restarted coordinator finds this peer again
        run = fetch_run(dht, args.run_id, initial_peers, timeout=args.config_timeout, coordinator=args.coordinator,
                        any_coordinator=args.any_coordinator)
        config = run.config
        if authorizer is not None:  # a private run: this peer refuses, as the coordinator does, the revoked tokens
            revocations = RevocationWatcher(dht, config.run_id, run.signer).start()
            # ...its averagers answer the run's members only, and it is one (hivetrain.membership)
            check_callers(dht, config.run_id)
            publish_membership(dht, config.run_id, authorizer)  # before its first request to an averager
            membership = MembershipPublisher(dht, config.run_id, authorizer).start()
        if expected is not None:  # the run's name may differ; everything that shapes training may not
            expected = expected.replace(run_id=config.run_id)
        if expected is not None and expected.fingerprint != config.fingerprint:
            raise SwarmError(
                f"the run's configuration (preset {config.preset!r}, fingerprint {config.fingerprint}) differs from"
                f" --preset {args.preset} (fingerprint {expected.fingerprint}): this peer would train another model"
            )
        if args.devices > 1 and config.swarm.mode != "diloco":
            raise SwarmError(
                f"--devices {args.devices} needs a diloco run (a peer on several devices trains DiLoCo's inner steps"
                f" with DDP), but run {config.run_id} is in {config.swarm.mode} mode: join it with --devices 1, or"
                f" start a run with coordinator/start.py --mode diloco"
            )
        training_stack.join()  # its imports must not be half done when the averagers fork
        return _train(args, dht, config, client_mode, coordinator_key=run.signer)
    except (SwarmError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        for watcher in (revocations, membership):
            if watcher is not None:
                watcher.stop()
        if dht is not None:
            dht.shutdown()


def _import_training_stack() -> None:
    """Lightning, torchvision and timm take seconds to import: a thread imports them while the DHT connects and the
    run's configuration arrives, so the first step comes that much sooner."""
    import hivetrain.data  # noqa: F401
    import hivetrain.model  # noqa: F401
    import hivetrain.module  # noqa: F401
    import hivetrain.diloco_ddp  # noqa: F401
    import hivetrain.strategy  # noqa: F401
    import hivetrain.roles.peers.progress  # noqa: F401


def _train(args: argparse.Namespace, dht, config, client_mode: bool, data_seed: int | None = None,
           coordinator_key: bytes | None = None, batch: dict | None = None) -> int:
    """Train with the swarm. `dht` is None on the other ranks of a peer on several devices (they never touch the
    swarm); rank 0, or a peer on one device, holds it. `coordinator_key` signed the run record: the peer obeys the
    rollback records it signs (on several devices, rank 0 watches for them and every rank takes the state). `batch`:
    the BatchChoice rank 0 made, handed to the other ranks (None: choose it here)."""
    import logging

    import lightning.pytorch as pl
    import torch

    from hivetrain.batch_size import BatchChoice, BatchSearchError
    from hivetrain.data import make_datamodule
    from hivetrain.datasets import DatasetUnavailable
    from hivetrain.round_schedule import rounds_description
    from hivetrain.events import EventLog
    from hivetrain.model import PretrainedWeightsUnavailable, choose_device, create_model, save_weights
    from hivetrain.module import ImageClassifier
    from hivetrain.speedups import apply_tf32, inner_loop_speedups
    from hivetrain.diloco_ddp import DiLoCoDDPStrategy
    from hivetrain.strategy import HivemindStrategy
    from hivetrain.swarm_options import HivemindOptions
    from hivetrain.roles.peers.progress import SwarmProgress

    speaks = dht is not None  # the peer's voice: one device, or rank 0 of several
    devices = args.devices
    if devices > 1:  # as run_role does for lightning.pytorch: its DDP set-up messages are no events of the peer
        logging.getLogger("lightning.fabric").propagate = False  # (its warnings still show)
    if args.threads:
        torch.set_num_threads(args.threads)
        if devices > 1:  # Lightning's launcher would give each rank its own share of the cores instead
            os.environ["OMP_NUM_THREADS"] = str(args.threads)
    device = choose_device(args.device)
    if device == "cuda" and devices > torch.cuda.device_count():
        print(f"error: --devices {devices}: this machine has {torch.cuda.device_count()} CUDA device(s)",
              file=sys.stderr)
        return 2
    try:
        choice = BatchChoice(**batch) if batch is not None else _choose_batch(args, config, device)
    except BatchSearchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    precision, batch_size = choice.precision, choice.micro_batch
    speedups = inner_loop_speedups(device, precision, compile=args.compile)
    apply_tf32(speedups)
    if data_seed is None:
        data_seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    # Not the host name: a display name goes to every peer and the dashboard. The peer ID's end is public already.
    name = args.name or (f"peer-{dht.peer_id.to_base58()[-6:]}" if dht is not None else "peer")
    if speaks:
        where = device if devices == 1 else f"{devices} {device} devices (DDP)"
        print(f"Joined run {config.run_id} (preset {config.preset}, fingerprint {config.fingerprint}) as {name}:"
              f" {where}, precision {precision},"
              f" speedups: {' '.join(speedup for speedup, on in speedups.items() if on) or 'none'},"
              f" {'client mode' if client_mode else 'reachable'}", flush=True)
        print(f"Batch: {choice.describe()}{', per device' if devices > 1 else ''}", flush=True)
        if config.swarm.mode == "diloco":
            print(f"Outer rounds: {rounds_description(config.swarm)}", flush=True)

    try:
        if speaks:
            model = create_model(config.model, args.pretrained_weights, seed=config.seed)
        else:  # its weights come from rank 0 when DDP starts: no pretrained download or file read here
            model = create_model(dataclasses.replace(config.model, pretrained=False), seed=config.seed)
        # The CPU only picks and augments the stored images; the device resizes and normalises whole batches
        # (hivetrain.pixels). On a GPU two worker processes have the next batches ready while the card computes.
        datamodule = make_datamodule(config, args.data_dir, batch_size=batch_size, seed=data_seed,
                                     num_workers=GPU_LOADER_WORKERS if device == "cuda" else 0,
                                     pin_memory=speedups["pinned_memory"], device_transforms=True)
        datamodule.prepare_data()
        datamodule.setup()
    except (DatasetUnavailable, PretrainedWeightsUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    module = ImageClassifier(config, model, compile_model=args.compile)
    options = HivemindOptions.for_run(config.run_id, config.swarm, batch_size, verbose=args.verbose,
                                      coordinator_key=coordinator_key)
    if devices == 1:
        strategy = HivemindStrategy(options, dht=dht, device=torch.device(device))
    else:
        strategy = DiLoCoDDPStrategy(options, dht=dht, data_seed=data_seed)
        if speaks:  # the ranks Lightning launches inherit this process's environment
            batch = dict(micro_batch=batch_size, accumulate=choice.accumulate, precision=precision,
                         reason=choice.reason)
            os.environ[RANK_SETUP_ENV] = json.dumps(dict(config=config.to_dict(), data_seed=data_seed, batch=batch))
    events = EventLog(args.events if speaks else None)
    events("batch_chosen", **choice.to_event())
    progress = SwarmProgress(batch_size=batch_size * devices, name=name,
                             hardware=_describe_hardware(device, devices) if speaks else "", client_mode=client_mode,
                             stop_at_epoch=args.stop_at_epoch, min_peers=args.min_peers, events=events,
                             speedups=speedups)
    show_bar = speaks and (args.progress_bar == "on" or (args.progress_bar == "auto" and sys.stdout.isatty()))
    trainer = pl.Trainer(
        accelerator=device,
        devices=devices,
        strategy=strategy,
        precision=precision,
        accumulate_grad_batches=choice.accumulate,  # the strategy counts this many batches per optimizer step
        max_epochs=-1,
        max_steps=args.max_steps,
        max_time=dict(minutes=args.max_time) if args.max_time else None,
        limit_val_batches=0,  # the coordinator validates the shared model; peers spend their time training
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=show_bar,
        enable_model_summary=False,
        callbacks=[progress],
    )
    started = time.monotonic()
    try:
        trainer.fit(module, datamodule=datamodule)
    except SystemExit:  # Lightning's answer to Ctrl-C: it has torn down (goodbye to peers), then exits 1
        if not trainer.interrupted:
            raise
    if not speaks:
        return 0
    # Rank 0 leaves after the ranks it launched: they end by themselves after training (DiLoCoDDPStrategy stopped
    # them already when training ended early).
    failed_ranks = [] if trainer.interrupted else _wait_for_other_ranks(trainer, OTHER_RANKS_EXIT_TIMEOUT)
    swarm_share = (f"; of {progress.train_seconds:.1f} s training, {progress.swarm_seconds:.1f} s in swarm rounds"
                   f" and state downloads" if progress.train_seconds else "")
    dropped = progress.trained - progress.samples
    dropped_share = f" ({dropped} more trained that never reached the swarm)" if dropped else ""
    print(f"Leaving at swarm epoch {progress.epoch} after {time.monotonic() - started:.0f} s:"
          f" contributed {progress.samples} samples{dropped_share}{swarm_share}.", flush=True)
    events("left", epoch=progress.epoch, samples=progress.samples, trained=progress.trained,
           train_seconds=progress.train_seconds,
           swarm_seconds=progress.swarm_seconds, missed_rounds=progress.missed_rounds,
           states_served=progress.states_served, wait_seconds=progress.wait_seconds,
           communication_seconds=progress.communication_seconds)
    if args.save_weights:
        save_weights(Path(args.save_weights), module.model, config, progress.epoch)
        print(f"Saved the weights to {args.save_weights}", flush=True)
    if trainer.interrupted:
        raise KeyboardInterrupt
    if failed_ranks:
        print(f"error: {'; '.join(failed_ranks)}", file=sys.stderr)
        return 1
    return 0


def _choose_batch(args: argparse.Namespace, config, device: str):
    """This peer's BatchChoice: --batch-size auto (the default on a GPU) runs trials of the run's model here."""
    from hivetrain.batch_size import DeviceInfo, TrialSpec, choose_peer_batch, run_trial

    def trial(size: int, precision: str, budget: int):
        # The dataset stays in host memory: a GPU's trial need not load it (and a CPU's budget leaves it aside).
        spec = TrialSpec(config, device, precision, args.threads, args.data_dir, load_dataset=False)
        return run_trial(spec, size, budget)

    return choose_peer_batch(DeviceInfo.detect(device), config.batch_size, config.swarm.target_batch_size,
                             args.batch_size, args.precision or config.precision, trial, args.memory_budget,
                             log=partial(print, flush=True))


def _describe_hardware(device: str, devices: int) -> str:
    from hivetrain.telemetry import describe_hardware

    hardware = describe_hardware(device)
    if devices == 1:
        return hardware
    return f"{devices} x {hardware}" if device == "cuda" else f"{hardware}, {devices} processes"


def _wait_for_other_ranks(trainer, timeout: float) -> list[str]:
    """Wait up to `timeout` seconds for the ranks that Lightning launched from this process to exit, kill those still
    running, and say which did not exit with 0 ("rank 1 exited with code 1")."""
    import subprocess

    failed = []
    launched = getattr(trainer.strategy.launcher, "procs", [])
    processes = list(launched)
    # From here on this function watches them: Lightning's process observer shares the list, and on a rank that failed
    # or was killed it would kill this process too, before its goodbye to the swarm.
    launched.clear()
    for rank, process in enumerate(processes, start=1):
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            failed.append(f"rank {rank} was still running {timeout:.0f} s after training (killed)")
            continue
        if code != 0:
            failed.append(f"rank {rank} exited with code {code}")
    return failed


if __name__ == "__main__":
    sys.exit(main())
