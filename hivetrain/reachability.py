"""Can the swarm dial this peer? The coordinator answers by dialling back (Petals' check): a peer behind NAT or a
firewall then joins in client mode by itself, whatever its addresses look like.

The peer starts a short-lived probe that listens where the peer will, and asks the coordinator to dial the probe's
addresses. The coordinator dials from a fresh probe of its own for each check, which has never been connected to
anything, so neither an existing connection nor a route learnt earlier can fake the answer. Requests and answers are
one JSON line each on a libp2p stream.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.utils.multiaddr import Multiaddr

from hivetrain.access import RunAuthorizer
from hivetrain.hivemind_internals import dial
from hivetrain.hivemind_internals.dht import node_authorizer
from hivetrain.swarm import daemon_start_error

logger = logging.getLogger(__name__)

DIAL_BACK = "hivetrain.dial_back"
DIAL_TIMEOUT = 10.0  # seconds the coordinator tries to dial a peer back
REQUEST_TIMEOUT = 5.0  # seconds an asker has to send its request
CHECK_INTERVAL = 10.0  # seconds before the same caller is dialled back again
MAX_DIALS_AT_ONCE = 4
MAX_QUEUED = 2 * MAX_DIALS_AT_ONCE  # checks dialling or waiting: at most two dials long (an asker waits 25 s)
MAX_ADDRESSES = 8  # a peer's visible addresses: a few per interface
MAX_CALLERS_REMEMBERED = 1024
DIAL_BACK_PURPOSE = "dial-back"  # what a private run's asker proves its grant for (RunAuthorizer.peer_proof)


@dataclass
class Reachability:
    reachable: Optional[bool]  # None: no initial peer could answer the question
    detail: str  # what was dialled, or why nothing could be asked


class DialBackService:
    """The coordinator's side. Anyone who reaches its port may ask, so a check must cost the asker more than it costs
    the coordinator (24 concurrent requests once left 25 p2pd processes under it):

    - each caller is dialled back at most once per CHECK_INTERVAL, and only the caller itself;
    - at most MAX_DIALS_AT_ONCE probes (a p2pd process each) run at once, and at most MAX_QUEUED checks wait;
    - the answer is reachable or not, never the dial's error, which told an asker what listens at any address the
      coordinator can reach;
    - in a private run, only an asker that shows a grant of the run for its own peer ID is dialled (`authorizer`)."""

    def __init__(self, authorizer: Optional[RunAuthorizer] = None):
        self.authorizer = authorizer  # a private run's RunAuthorizer: only a grant's holder is dialled back
        self.dials = asyncio.Semaphore(MAX_DIALS_AT_ONCE)
        self.queued = 0  # checks waiting for a probe: a coroutine each, no process
        self.last_check: dict[PeerID, float] = {}

    async def handle(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = json.loads(await asyncio.wait_for(reader.readline(), REQUEST_TIMEOUT))
            # p2pd wants bare transport addresses: the peer ID travels separately
            maddrs = [Multiaddr(m.split("/p2p/")[0]) for m in request["maddrs"][:MAX_ADDRESSES]]
        except Exception as e:  # a malformed request gets an answer too, never a crash
            answer = dict(reachable=None, error=f"bad request: {type(e).__name__}")
        else:
            try:
                answer = (self._no_grant(stream_info.peer_id, request) or self._refusal(stream_info.peer_id)
                          or await self._check(stream_info.peer_id, maddrs))
            except Exception as e:  # the probe's p2pd did not start, say: the asker hears so rather than EOF
                logger.warning(f"A dial-back check failed: {type(e).__name__}: {e}")
                answer = dict(reachable=None, error="the coordinator could not check now")
        writer.write(json.dumps(answer).encode() + b"\n")
        await writer.drain()
        writer.close()

    def _no_grant(self, caller: PeerID, request: dict) -> Optional[dict]:
        """In a private run, the refusal of an asker that shows no grant of the run for its own peer ID."""
        if self.authorizer is None:
            return None
        try:
            grant = {field: base64.b64decode(value) if isinstance(value, str) and field != "name" else value
                     for field, value in request["grant"].items()}
        except Exception:  # no grant, or one that does not decode
            grant = {}
        if self.authorizer.is_peer_proof_valid(DIAL_BACK_PURPOSE, caller.to_bytes(), grant):
            return None
        return dict(reachable=None, error="this run is private: ask with a valid token")

    def _refusal(self, caller: PeerID) -> Optional[dict]:
        now = time.monotonic()
        if now - self.last_check.get(caller, -CHECK_INTERVAL) < CHECK_INTERVAL:
            return dict(reachable=None, error=f"checked less than {CHECK_INTERVAL:g} s ago")
        if self.queued >= MAX_QUEUED:
            return dict(reachable=None, error="busy with other checks")
        if len(self.last_check) > MAX_CALLERS_REMEMBERED:
            self.last_check = {peer: at for peer, at in self.last_check.items() if now - at < CHECK_INTERVAL}
        self.last_check[caller] = now
        return None

    async def _check(self, caller: PeerID, maddrs: list[Multiaddr]) -> dict:
        self.queued += 1
        try:
            async with self.dials:  # joiners that start together wait their turn, a second or so each
                return dict(reachable=await _dial(caller, maddrs))
        finally:
            self.queued -= 1


async def serve_dial_back(dht, node) -> None:
    """Run inside the coordinator's DHT process (DHT.run_coroutine): answer dial-back requests on its libp2p host; in
    a private run, only those of a grant's holder (checked by the node's own authorizer, revocations included)."""
    authorizer = node_authorizer(node)
    service = DialBackService(authorizer if isinstance(authorizer, RunAuthorizer) else None)
    await node.p2p.add_binary_stream_handler(DIAL_BACK, service.handle)


async def _dial(peer_id: PeerID, maddrs: list[Multiaddr]) -> bool:
    # A fresh host for every check. When the given addresses fail, libp2p looks the peer up in its own DHT: a host
    # that dialled earlier peers knows the coordinator through them, and the coordinator knows this peer's real
    # address. A reused host once answered "reachable" for an address nobody listens on.
    probe = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])  # dials out only
    try:
        await asyncio.wait_for(dial(probe, peer_id, maddrs), DIAL_TIMEOUT)
        return True
    except Exception:  # refused, timed out, wrong peer behind the address: not reachable
        return False
    finally:
        await probe.shutdown()


async def _ask(initial_peers: Sequence[str], host_maddrs: Sequence[str], announce_maddrs: Sequence[str],
               timeout: float, authorizer=None) -> Reachability:
    probe = await P2P.create(initial_peers=list(initial_peers), host_maddrs=list(host_maddrs),
                             announce_maddrs=list(announce_maddrs) or None)
    try:
        maddrs = [str(m) for m in await probe.get_visible_maddrs()]
        asked = dict(peer_id=probe.peer_id.to_base58(), maddrs=maddrs)
        if authorizer is not None:  # a private run: the probe (a peer ID of its own) acts for this peer's grant
            asked["grant"] = {field: base64.b64encode(value).decode() if isinstance(value, bytes) else value
                              for field, value in authorizer.peer_proof(DIAL_BACK_PURPOSE,
                                                                        probe.peer_id.to_bytes()).items()}
        request = json.dumps(asked).encode() + b"\n"
        problems = []
        for address in initial_peers:
            peer_id = PeerID.from_base58(str(address).rsplit("/p2p/", 1)[-1])
            try:
                _, reader, writer = await asyncio.wait_for(probe.call_binary_stream_handler(peer_id, DIAL_BACK),
                                                           timeout)
                writer.write(request)
                await writer.drain()
                line = await asyncio.wait_for(reader.readline(), timeout + DIAL_TIMEOUT)
                writer.close()
                if not line:  # the stream closed without an answer
                    problems.append(f"{address}: no answer")
                    continue
                answer = json.loads(line)
            except Exception as e:  # this initial peer does not answer (or is not a coordinator): ask the next
                problems.append(f"{address}: {type(e).__name__}")
                continue
            if answer.get("reachable") is None:
                problems.append(f"{address}: {answer.get('error')}")
                continue
            if answer["reachable"]:
                return Reachability(True, f"the coordinator dialled this peer back at {', '.join(maddrs)}")
            return Reachability(False, f"the coordinator could not dial this peer back at {', '.join(maddrs)}")
        return Reachability(None, "no initial peer answered the dial-back check (" + "; ".join(problems) + ")")
    finally:
        await probe.shutdown()


def check_reachability(initial_peers: Sequence[str], host_maddrs: Sequence[str],
                       announce_maddrs: Sequence[str] = (), timeout: float = 15.0, authorizer=None) -> Reachability:
    """Ask the initial peers (the coordinator) to dial a probe listening on `host_maddrs` back; in a private run with
    this peer's `authorizer` (hivetrain.access.RunAuthorizer), which shows its grant. Raises SwarmError when none of
    them can be reached at all."""
    try:
        return asyncio.run(_ask(initial_peers, host_maddrs, announce_maddrs, timeout, authorizer))
    except P2PDaemonError as e:
        raise daemon_start_error(e, list(initial_peers)) from None
