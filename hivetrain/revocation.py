"""Revoked tokens: the coordinator's signed list of the grants a private run's owner took back, and a peer's watch
for it.

The owner revokes a token on the coordinator's machine (`coordinator/start.py revoke-token`,
hivetrain.roles.coordinator.tokens); the coordinator's own authorizer refuses it at once, and the coordinator
publishes the list under `<run_id>_revoked`, signed as its rollback records are (an entry whose subkey is its
identity key, signed with it). A peer of a private run reads it every few seconds (RevocationWatcher) and hands it
to its authorizer, in the DHT's process, which then refuses every request and answer of a revoked grant's holder:
that peer drops out of the honest peers' DHT, and their averagers check their callers' grants again
(hivetrain.membership).

A peer believes only the list signed by the key that signed the run record it joined with (the join command's pin):
an entry under another key is skipped, with one warning per key that wrote one. A list names grants by their holder
fingerprint (hivetrain.access.holder_fingerprint); it holds at most MAX_REVOKED of them, so that it fits in one record,
and the coordinator leaves out those whose grants have expired (they are refused anyway). A list never shrinks on its
own at a peer: the latest one read stands until a newer one arrives, whatever the DHT returns meanwhile.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Iterable, Optional

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from pydantic.v1 import BaseModel, StrictFloat, StrictStr, conbytes, conlist

from hivetrain.access import FINGERPRINT_BYTES, RunAuthorizer
from hivetrain.clock import RecordWatcher
from hivetrain.hivemind_internals.dht import node_authorizer
from hivetrain.membership import check_members_again
from hivetrain.record_guard import KeyRule, guard_keys, signer_peer_id, warn_skipped
from hivetrain.swarm import DHT_READ_TIMEOUT, read_signed_records

logger = logging.getLogger(__name__)

# Grants one list may revoke: 4096 fingerprints of 12 bytes take 57 KB packed, within the 64 KiB every node accepts
# for a record (hivetrain.record_guard.MAX_RECORD_BYTES). A run that needs more issues shorter tokens.
MAX_REVOKED = 4096
REVOCATION_TTL = 60.0  # seconds a published list lives unless the coordinator refreshes it (as its run record)
# Seconds between a peer's reads of the list: a revoked holder is refused this long (and a DHT read) after the
# coordinator publishes, while a swarm of peers reading a full list stays far below a megabyte per second per holder.
WATCH_REVOCATIONS_EVERY = 5.0
MAX_FOREIGN_SIGNERS_REPORTED = 1000  # keys a peer remembers having warned about; beyond, warnings are rate-limited

HolderFingerprint = conbytes(strict=True, min_length=FINGERPRINT_BYTES, max_length=FINGERPRINT_BYTES)


def revocation_key(run_id: str) -> str:
    return f"{run_id}_revoked"


class RevocationRecord(BaseModel):
    run_id: StrictStr
    holders: conlist(HolderFingerprint, max_items=MAX_REVOKED)  # the revoked grants' holder fingerprints
    time: StrictFloat  # when the coordinator published it: orders its lists, nothing more


def revocation_rules(run_id: str) -> list[KeyRule]:
    return [KeyRule(revocation_key(run_id), "signed", RevocationRecord)]


def publish_revocations(dht: hivemind.DHT, run_id: str, holders: Iterable[bytes],
                        ttl: float = REVOCATION_TTL) -> bool:
    """Store the list of revoked holder fingerprints under the run's revocation key, signed with this process's key (the
    coordinator's identity key, as its run record). Returns hivemind's answer: that of the last node to reply.

    Args:
        dht: the coordinator's DHT node.
        run_id: the run whose tokens are revoked.
        holders: at most MAX_REVOKED holder fingerprints (hivetrain.access.holder_fingerprint).
        ttl: seconds the record lives unless published again.
    """
    guard_keys(dht, revocation_rules(run_id))
    record = RevocationRecord(run_id=run_id, holders=sorted(set(holders)), time=get_dht_time())
    return dht.store(revocation_key(run_id), subkey=RSASignatureValidator().local_public_key, value=record.dict(),
                     expiration_time=get_dht_time() + ttl)


class ForeignSigners:
    """The keys that wrote a revocation list that is not the coordinator's: one warning per key (the first
    MAX_FOREIGN_SIGNERS_REPORTED keys; then rate-limited warnings, so that a flood of keys costs no memory)."""

    def __init__(self, key: str):
        self.key = key
        self.reported: set[bytes] = set()

    def report(self, signer: bytes) -> None:
        if signer in self.reported:
            return
        if len(self.reported) >= MAX_FOREIGN_SIGNERS_REPORTED:
            warn_skipped(self.key, "not signed by the run's coordinator")
            return
        self.reported.add(signer)
        logger.warning(f"Ignoring a revocation list under {self.key} signed by {signer_peer_id(signer)}'s key, not by"
                       f" the run's coordinator (further lists from that key are ignored silently)")


def read_revocations(dht: hivemind.DHT, run_id: str, coordinator_key: bytes, foreign: ForeignSigners,
                     timeout: float = DHT_READ_TIMEOUT) -> Optional[RevocationRecord]:
    """The coordinator's newest revocation list of run `run_id`, or None when the DHT holds none.

    Args:
        dht: this peer's DHT node.
        run_id: the run it trains in.
        coordinator_key: the subkey its run record was signed under (the coordinator's public key, pinned by the
            join command): a list under any other key is ignored, reported once per key through `foreign`.
        foreign: the keys already reported.
        timeout: seconds the read may take.
    """
    rule = revocation_rules(run_id)[0]
    guard_keys(dht, [rule])
    newest = None
    for signer, record in read_signed_records(dht, rule.key, RevocationRecord, timeout):  # shape-checked already
        if signer != coordinator_key:
            foreign.report(signer)
        elif record.run_id != run_id:
            warn_skipped(rule.key, "malformed", f"it names run {record.run_id!r}")
        elif newest is None or record.time > newest.time:
            newest = record
    return newest


async def _set_revoked(holders: frozenset[bytes], _dht: hivemind.DHT, node) -> bool:
    """Inside the DHT's process, where hivemind runs the authorizer: hand it the revoked holders."""
    authorizer = node_authorizer(node)
    if not isinstance(authorizer, RunAuthorizer):
        return False
    authorizer.set_revoked(holders)
    check_members_again(node)  # the averagers' callers too, not only the DHT's requests from now on
    return True


def apply_revocations(dht: hivemind.DHT, holders: Iterable[bytes], timeout: float = DHT_READ_TIMEOUT) -> bool:
    """Make this node's authorizer refuse the grants of `holders` (holder fingerprints; the whole list, replacing the
    one before) from its next request on. False when the node has no RunAuthorizer (a public run)."""
    return dht.run_coroutine(partial(_set_revoked, frozenset(holders)), return_future=True).result(timeout=timeout)


class RevocationWatcher(RecordWatcher[RevocationRecord]):
    """A peer's watch: a thread reads the coordinator's revocation list every `every` seconds and hands each new one
    to this peer's authorizer. A list older than the one applied (a node that missed the coordinator's latest) is
    not applied: a revocation is never undone but by a newer list.

    Args:
        dht: this peer's DHT node, started with a RunAuthorizer.
        run_id: the run it trains in.
        coordinator_key: the subkey the run record was signed under (hivetrain.run_record.PinnedRun.signer).
        every: seconds between two reads.
    """

    def __init__(self, dht: hivemind.DHT, run_id: str, coordinator_key: bytes,
                 every: float = WATCH_REVOCATIONS_EVERY):
        super().__init__(self._read_and_apply, "revocation-watcher", every)
        self.dht, self.run_id, self.coordinator_key = dht, run_id, coordinator_key
        self.foreign = ForeignSigners(revocation_key(run_id))
        self.applied: Optional[RevocationRecord] = None  # the list this peer's authorizer holds

    def _read_and_apply(self) -> Optional[RevocationRecord]:
        record = read_revocations(self.dht, self.run_id, self.coordinator_key, self.foreign)
        if record is None or (self.applied is not None and record.time <= self.applied.time):
            return record
        if set(record.holders) != set(self.applied.holders if self.applied is not None else ()):
            apply_revocations(self.dht, record.holders)
            logger.info(f"The run's coordinator revokes {len(record.holders)} token(s): their holders' requests"
                        f" are refused")
        self.applied = record
        return record
