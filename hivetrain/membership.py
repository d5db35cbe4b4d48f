"""Who may call a private run's averagers: the peers whose grants vouch for them.

A private run's token guards its DHT (hivetrain.access), but hivemind's averagers answer their RPCs (state downloads,
join requests, parts of an all-reduce) on the libp2p host, to anyone who can reach its port: a host with no token
could download the run's model from any peer that serves its state. So every peer of a private run publishes a member
record under `<run_id>_members`, signed as its other records are: its libp2p peer ID, its grant, and the grant
holder's signature of the run and that peer ID (RunAuthorizer.peer_proof). libp2p authenticates peer IDs, so a record
seen in the DHT is worthless to any other host, and a member record names no secret.

An averager of a private run (hivetrain.hivemind_internals.MembersOnly) asks its DHT process about each caller it has
not admitted lately (`check_callers` wires that up before the averagers start). There the peer's own authorizer,
which holds the run's authority and revocation list, checks the callers' records: an expired grant stops counting
within MEMBER_CACHE_SECONDS, a revoked one as soon as the revocation list reaches the peer (check_members_again). A
caller that is no member costs one DHT read per UNKNOWN_CALLER_READ_EVERY seconds at most, whatever it sends.
"""

from __future__ import annotations

import logging
import time
from functools import partial

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from pydantic.v1 import BaseModel, StrictFloat, StrictStr, conbytes, conint, constr

from hivetrain.access import RunAuthorizer
from hivetrain.clock import RecordWatcher
from hivetrain.hivemind_internals import MembersOnly
from hivetrain.hivemind_internals.dht import node_authorizer
from hivetrain.record_guard import INT64_MAX, KeyRule, guard_keys, usable_entries
from hivetrain.swarm import DHT_READ_TIMEOUT

logger = logging.getLogger(__name__)

MEMBER_TTL = 120.0  # seconds a member record lives unless its peer publishes it again
PUBLISH_EVERY = 30.0  # seconds between a peer's publications of its record: several before it expires
MEMBER_CACHE_SECONDS = 30.0  # seconds a caller counts as a member after its record was last read and checked
UNKNOWN_CALLER_READ_EVERY = 1.0  # seconds between two DHT reads that one unknown caller's requests may cause
MAX_CALLERS_REMEMBERED = 4096


def members_key(run_id: str) -> str:
    return f"{run_id}_members"


def member_purpose(run_id: str) -> str:
    """What a member record's proof is for (RunAuthorizer.peer_proof): calling run `run_id`'s averagers."""
    return f"averagers of run {run_id}"


class MemberRecord(BaseModel):
    run_id: StrictStr
    peer_id: conbytes(strict=True, min_length=1, max_length=128)  # the libp2p peer ID (PeerID.to_bytes())
    name: constr(strict=True, max_length=1024)  # the grant's volunteer
    holder: conbytes(strict=True, max_length=4096)  # the public key the grant names
    expires: conint(strict=True, ge=0, le=INT64_MAX)
    grant_signature: conbytes(strict=True, max_length=4096)
    proof: conbytes(strict=True, max_length=4096)  # the holder's signature of the purpose and the peer ID
    time: StrictFloat


def member_rules(run_id: str) -> list[KeyRule]:
    return [KeyRule(members_key(run_id), "signed", MemberRecord)]


def publish_membership(dht: hivemind.DHT, run_id: str, authorizer: RunAuthorizer, ttl: float = MEMBER_TTL) -> bool:
    """Store this peer's member record, signed with this process's key (one entry per key). Returns hivemind's
    answer: that of the last node to reply."""
    guard_keys(dht, member_rules(run_id))
    peer_id = dht.peer_id.to_bytes()
    record = MemberRecord(run_id=run_id, peer_id=peer_id, time=get_dht_time(),
                          **authorizer.peer_proof(member_purpose(run_id), peer_id))
    return dht.store(members_key(run_id), subkey=RSASignatureValidator().local_public_key, value=record.dict(),
                     expiration_time=get_dht_time() + ttl)


class MembershipPublisher(RecordWatcher[bool]):
    """A thread that publishes this peer's member record every PUBLISH_EVERY seconds, the first time at once."""

    def __init__(self, dht: hivemind.DHT, run_id: str, authorizer: RunAuthorizer, every: float = PUBLISH_EVERY):
        super().__init__(partial(publish_membership, dht, run_id, authorizer), "membership-publisher", every)


class MemberList:
    """In a DHT process: the peers of run `run_id` whose member records its authorizer accepted lately."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self.admitted: dict[bytes, float] = {}  # peer ID -> time.monotonic() until which it counts as a member
        self.next_read_for: dict[bytes, float] = {}  # unknown caller -> when its next request may cause a read

    async def admits(self, peer_id: bytes, node, authorizer: RunAuthorizer) -> bool:
        now = time.monotonic()
        if self.admitted.get(peer_id, 0.0) > now:
            return True
        if now < self.next_read_for.get(peer_id, 0.0):
            return False
        if len(self.next_read_for) >= MAX_CALLERS_REMEMBERED:
            self.next_read_for = {peer: at for peer, at in self.next_read_for.items() if at > now}
        self.next_read_for[peer_id] = now + UNKNOWN_CALLER_READ_EVERY
        self._take(await node.get(members_key(self.run_id), latest=True), authorizer, now)
        return self.admitted.get(peer_id, 0.0) > now

    def _take(self, found, authorizer: RunAuthorizer, now: float) -> None:
        key, purpose = members_key(self.run_id), member_purpose(self.run_id)
        admitted = {peer: until for peer, until in self.admitted.items() if until > now}
        for _, _, record in usable_entries(key, found.value if found is not None else None, MemberRecord):
            if record.run_id == self.run_id and authorizer.is_peer_proof_valid(purpose, record.peer_id,
                                                                                record.dict()):
                lasts = min(MEMBER_CACHE_SECONDS, record.expires - time.time())
                admitted[record.peer_id] = max(admitted.get(record.peer_id, 0.0), now + lasts)
        self.admitted = admitted


_member_lists: dict[int, MemberList] = {}  # in a DHT process: id(node) -> the run whose members it admits


async def _admit_members_of(run_id: str, _dht: hivemind.DHT, node) -> None:
    _member_lists[id(node)] = MemberList(run_id)


def check_members_again(node) -> None:
    """In a DHT process: every caller admitted so far is checked again at its next request (a revocation list just
    applied: a caller admitted under a grant it revokes was answered on for MEMBER_CACHE_SECONDS)."""
    members = _member_lists.get(id(node))
    if members is not None:
        members.admitted = {}


async def is_member(peer_id: bytes, _dht: hivemind.DHT, node) -> bool:
    """In the DHT's process (DHT.run_coroutine): whether the peer `peer_id` may call this peer's averagers. In a public
    run, anyone may; in a private run, a member of the run named by check_callers, and nobody before it was named."""
    authorizer = node_authorizer(node)
    if not isinstance(authorizer, RunAuthorizer):
        return True
    members = _member_lists.get(id(node))
    return members is not None and await members.admits(peer_id, node, authorizer)


def check_callers(dht: hivemind.DHT, run_id: str, timeout: float = DHT_READ_TIMEOUT) -> None:
    """From now on, the averagers this process creates answer only the members of private run `run_id` (in a public
    run, anyone, as before). Call it before they start: each averager's process forks with the check in place."""
    guard_keys(dht, member_rules(run_id))
    dht.run_coroutine(partial(_admit_members_of, run_id), return_future=True).result(timeout=timeout)
    MembersOnly.caller_check = staticmethod(is_member)
