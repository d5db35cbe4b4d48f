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
import logging
import shlex
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Optional

from hivetrain.roles.coordinator.options import parse_args, run_config


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
    # A round paced in seconds is as large as what the swarm trains in that time: 0 until the peers' records state a
    # rate (their first ones do not), when "1728/0 samples" would say the round was overdue
    target = f"/{snapshot.target_batch_size}" if snapshot.target_batch_size else ""
    return (f"swarm epoch {snapshot.epoch} | {snapshot.alive_peers} peer{'s' if snapshot.alive_peers > 1 else ''}"
            f"{clients} | {snapshot.samples_per_second:.0f} samples/s | {snapshot.samples_accumulated}{target}"
            f" samples toward the next epoch{eta}{loss}{looked}")


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
    from hivetrain.round_schedule import rounds_description
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
