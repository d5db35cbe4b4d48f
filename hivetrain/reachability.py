"""Can the swarm dial this peer? The coordinator answers by dialling back (Petals' check): a peer behind NAT or a
firewall then joins in client mode by itself, whatever its addresses look like.

The peer starts a short-lived probe that listens where the peer will, and asks the coordinator to dial the probe's
addresses. The coordinator dials from a fresh probe of its own for each check, which has never been connected to
anything, so neither an existing connection nor a route learnt earlier can fake the answer. Requests and answers are
one JSON line each on a libp2p stream.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Optional, Sequence

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from hivetrain.hivemind_internals import dial

DIAL_BACK = "hivetrain.dial_back"
DIAL_TIMEOUT = 10.0  # seconds the coordinator tries to dial a peer back


@dataclass
class Reachability:
    reachable: Optional[bool]  # None: no initial peer could answer the question
    detail: str  # what was dialled, or why nothing could be asked


async def serve_dial_back(dht, node) -> None:
    """Run inside the coordinator's DHT process (DHT.run_coroutine): answer dial-back requests on its libp2p host."""

    async def handle(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = json.loads(await reader.readline())
            peer_id = PeerID.from_base58(request["peer_id"])
            # p2pd wants bare transport addresses: the peer ID travels separately
            maddrs = [Multiaddr(m.split("/p2p/")[0]) for m in request["maddrs"]][:16]
            answer = await _dial(peer_id, maddrs)
        except Exception as e:  # a malformed request gets an answer too, never a crash
            answer = dict(reachable=None, error=f"bad request: {type(e).__name__}")
        writer.write(json.dumps(answer).encode() + b"\n")
        await writer.drain()
        writer.close()

    await node.p2p.add_binary_stream_handler(DIAL_BACK, handle)


async def _dial(peer_id: PeerID, maddrs: list[Multiaddr]) -> dict:
    # A fresh host for every check. When the given addresses fail, libp2p looks the peer up in its own DHT: a host
    # that dialled earlier peers knows the coordinator through them, and the coordinator knows this peer's real
    # address. A reused host once answered "reachable" for an address nobody listens on.
    probe = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])  # dials out only
    try:
        await asyncio.wait_for(dial(probe, peer_id, maddrs), DIAL_TIMEOUT)
        return dict(reachable=True)
    except Exception as e:  # refused, timed out, wrong peer behind the address: not reachable
        return dict(reachable=False, error=" ".join(f"{type(e).__name__}: {e}".split())[:300])
    finally:
        await probe.shutdown()


async def _ask(initial_peers: Sequence[str], host_maddrs: Sequence[str], announce_maddrs: Sequence[str],
               timeout: float) -> Reachability:
    probe = await P2P.create(initial_peers=list(initial_peers), host_maddrs=list(host_maddrs),
                             announce_maddrs=list(announce_maddrs) or None)
    try:
        maddrs = [str(m) for m in await probe.get_visible_maddrs()]
        request = json.dumps(dict(peer_id=probe.peer_id.to_base58(), maddrs=maddrs)).encode() + b"\n"
        problems = []
        for address in initial_peers:
            peer_id = PeerID.from_base58(str(address).rsplit("/p2p/", 1)[-1])
            try:
                _, reader, writer = await asyncio.wait_for(probe.call_binary_stream_handler(peer_id, DIAL_BACK),
                                                           timeout)
                writer.write(request)
                await writer.drain()
                answer = json.loads(await asyncio.wait_for(reader.readline(), timeout + DIAL_TIMEOUT))
                writer.close()
            except Exception as e:  # this initial peer does not answer (or is not a coordinator): ask the next
                problems.append(f"{address}: {type(e).__name__}")
                continue
            if answer.get("reachable") is None:
                problems.append(f"{address}: {answer.get('error')}")
                continue
            if answer["reachable"]:
                return Reachability(True, f"the coordinator dialled this peer back at {', '.join(maddrs)}")
            return Reachability(False, f"the coordinator could not dial this peer back at {', '.join(maddrs)}"
                                       f" ({answer.get('error', 'no detail')})")
        return Reachability(None, "no initial peer answered the dial-back check (" + "; ".join(problems) + ")")
    finally:
        await probe.shutdown()


def check_reachability(initial_peers: Sequence[str], host_maddrs: Sequence[str],
                       announce_maddrs: Sequence[str] = (), timeout: float = 15.0) -> Reachability:
    """Ask the initial peers (the coordinator) to dial a probe listening on `host_maddrs` back."""
    return asyncio.run(_ask(initial_peers, host_maddrs, announce_maddrs, timeout))
