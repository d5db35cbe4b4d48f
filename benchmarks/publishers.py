"""Lightweight stand-ins for training peers, to load the coordinator's monitor with hundreds of them on one machine.

    python -m benchmarks.publishers --initial-peers ADDR ... --run-id RUN --count 64 [--every 5] [--events FILE]

One process hosts `count` DHT nodes in client mode that share one p2p daemon (a client node serves nothing, so they
need no handlers of their own). Each has its own RSA key, and every `every` seconds it publishes what a real peer
publishes about itself: a HiveTrain metrics record (hivetrain.telemetry) and a hivemind progress record, both signed
by that key under the run's keys, with the lifetimes real peers use. To the coordinator they are `count` peers; they
train nothing, so hundreds fit where a handful of training peers would fill the cores.

Once every node has published once it says so (a line, and a "publishing" event with --events), then runs until it is
stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import time

from hivemind.p2p import P2P, PeerID
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.optim.progress_tracker import LocalTrainingProgress
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from hivetrain.events import EventLog
from hivetrain.run_record import signer_peer_id
from hivetrain.swarm import RECORD_LIFETIME
from hivetrain.telemetry import PEER_RECORD_TTL, PUBLISH_EVERY, PeerRecord, metrics_key, progress_key


async def publish_forever(node: DHTNode, signer: RSASignatureValidator, run_id: str, name: str, every: float,
                          stopped: asyncio.Event, first: asyncio.Future) -> None:
    # The nodes share one P2P (one libp2p peer ID): each simulated peer goes by the peer ID of its own signing key, as
    # a real peer's ID is its own (the coordinator keeps one row per peer ID, written by the key that claimed it).
    peer_id = PeerID.from_base58(signer_peer_id(signer.local_public_key))
    samples, started = 0, time.time()
    while not stopped.is_set():
        samples += random.randint(32, 64)
        now = time.time()
        record = PeerRecord(peer_id=peer_id.to_base58(), name=name, hardware="simulated publisher", client_mode=False,
                            epoch=0, samples_per_second=10.0, loss=2.0, samples=samples, time=now,
                            train_seconds=now - started, swarm_seconds=0.0)
        progress = LocalTrainingProgress(peer_id=peer_id.to_bytes(), epoch=0, samples_accumulated=samples % 64,
                                         samples_per_second=10.0, time=now, client_mode=False)
        expiration = get_dht_time()
        await asyncio.gather(
            node.store(metrics_key(run_id), record.dict(), expiration + PEER_RECORD_TTL, subkey=signer.local_public_key),
            node.store(progress_key(run_id), progress.dict(), expiration + RECORD_LIFETIME,
                       subkey=signer.local_public_key))
        if not first.done():
            first.set_result(None)
        try:  # spread the stores as real peers' are spread, not all in one burst
            await asyncio.wait_for(stopped.wait(), every * random.uniform(0.8, 1.2))
        except asyncio.TimeoutError:
            pass


async def main_async(args: argparse.Namespace) -> None:
    p2p = await P2P.create(initial_peers=args.initial_peers)
    stopped = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(signum, stopped.set)
    nodes, tasks, firsts = [], [], []
    try:
        for index in range(args.count):
            # each node signs with its own key: a peer may write only its own subkey
            signer = RSASignatureValidator(RSAPrivateKey())
            node = await DHTNode.create(p2p=p2p, initial_peers=args.initial_peers, client_mode=True,
                                        record_validator=signer, num_workers=4)
            nodes.append(node)
            firsts.append(asyncio.get_running_loop().create_future())
            tasks.append(asyncio.create_task(publish_forever(node, signer, args.run_id, f"{args.name}-{index}",
                                                             args.every, stopped, firsts[-1])))
        await asyncio.gather(*firsts)
        print(f"publishing {args.count} peers", flush=True)
        EventLog(args.events)("publishing", peers=args.count)
        await stopped.wait()
    finally:
        stopped.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for node in nodes:
            await node.shutdown()
        await p2p.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.publishers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--initial-peers", nargs="+", required=True, help="the coordinator's multiaddresses")
    parser.add_argument("--run-id", required=True, help="the run to publish records for")
    parser.add_argument("--count", type=int, default=64, help="simulated peers in this process (default: %(default)s)")
    parser.add_argument("--every", type=float, default=PUBLISH_EVERY,
                        help="seconds between one peer's records (default: %(default)s, as real peers)")
    parser.add_argument("--name", default="publisher", help="prefix of the simulated peers' names")
    parser.add_argument("--events", default=None, metavar="FILE", help="write events here, one JSON object per line")
    asyncio.run(main_async(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
