"""Start a HiveTrain run: the swarm's bootstrap peer.

    python coordinator/start.py --preset demo --host 127.0.0.1

It listens on a stable address (same port and peer ID across restarts), publishes the run's configuration for
joiners, prints the command volunteers paste to join, and reports the swarm's progress until Ctrl-C.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

DEFAULT_PORT = 31337


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from hivetrain.config import DEFAULT_PRESET, PRESETS

    parser = argparse.ArgumentParser(
        prog="python coordinator/start.py",
        description="Start a HiveTrain run and keep its swarm together.",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default=DEFAULT_PRESET, help="what the run trains (default: %(default)s)")
    parser.add_argument("--run-id", help="name of the run (default: the preset's); no '.' or '/'")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: %(default)s; 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="TCP port to listen on; keep it stable (default: %(default)s; 0: any free port)")
    parser.add_argument("--announce", nargs="+", default=[], metavar="MULTIADDR",
                        help="addresses volunteers should dial instead of the listening ones (public IP, port"
                             " forwarding), e.g. /ip4/203.0.113.7/tcp/31337")
    parser.add_argument("--identity", default=None, metavar="FILE",
                        help="private key file that keeps the peer ID stable (default:"
                             " ~/.cache/hivetrain/<run-id>/coordinator.key; created on first start)")
    parser.add_argument("--refresh", type=float, default=10.0, help="seconds between swarm status lines (default: %(default)s)")
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error("--port must be in 0..65535")
    if args.refresh <= 0:
        parser.error("--refresh must be positive")
    return args


def read_progress(dht, run_id: str) -> tuple[int, int, int]:
    """(swarm epoch, peers, samples accumulated toward the next epoch) from hivemind's own progress records."""
    found = dht.get(f"{run_id}_progress", latest=True)
    if found is None or not isinstance(found.value, dict):
        return 0, 0, 0
    records = [entry.value for entry in found.value.values() if isinstance(getattr(entry, "value", None), dict)]
    epoch = max((r.get("epoch", 0) for r in records), default=0)
    samples = sum(r.get("samples_accumulated", 0) for r in records if r.get("epoch") == epoch)
    return epoch, len(records), samples


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("lightning.pytorch").propagate = False  # it prints its own messages already
    from hivetrain.config import get_preset
    from hivetrain.swarm import (
        RUN_RECORD_TTL, DHTOptions, SwarmError, join_command, leave_on_sigterm, listen_maddr, publish_run_config,
        start_dht, visible_addresses,
    )

    leave_on_sigterm()

    dht = None
    try:
        config = get_preset(args.preset)
        if args.run_id:
            config = config.replace(run_id=args.run_id)
        identity = Path(args.identity or Path.home() / ".cache" / "hivetrain" / config.run_id / "coordinator.key")
        identity.parent.mkdir(parents=True, exist_ok=True)
        dht = start_dht(DHTOptions(
            host_maddrs=[listen_maddr(args.host, args.port)], announce_maddrs=args.announce,
            identity_path=str(identity),
        ))
        addresses, loopback_only = visible_addresses(dht)
        print(f"Run {config.run_id}: preset {config.preset}, fingerprint {config.fingerprint},"
              f" peer ID {dht.peer_id.to_base58()}", flush=True)
        if loopback_only:
            print("Only loopback addresses exist: volunteers can join from this machine only"
                  " (use --host 0.0.0.0, or --announce with your public address).", flush=True)
        print(f"To join, run:\n  {join_command(addresses)}", flush=True)
        next_publish = next_status = 0.0
        while True:
            now = time.monotonic()
            if now >= next_publish:
                # Refresh well before the record expires, so a joiner always finds it.
                if not publish_run_config(dht, config):
                    logging.warning("Could not store the run's configuration in the DHT; retrying")
                next_publish = now + RUN_RECORD_TTL / 3
            if now >= next_status:
                epoch, peers, samples = read_progress(dht, config.run_id)
                if peers:
                    print(f"swarm epoch {epoch} | {peers} peer{'s' if peers > 1 else ''} | {samples}/"
                          f"{config.swarm.target_batch_size} samples toward the next epoch", flush=True)
                else:
                    print("waiting for peers", flush=True)
                next_status = now + args.refresh
            time.sleep(0.5)
    except (SwarmError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("Coordinator stopped.", flush=True)
        return 0
    finally:
        if dht is not None:
            dht.shutdown()


if __name__ == "__main__":
    sys.exit(main())
