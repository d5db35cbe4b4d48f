"""Rollback to the best validated state: the coordinator's signed order to the peers, and a peer's watch for it.

When the coordinator's validation sees top-1 fall far below the best, or a non-finite loss, it serves the best
checkpoint's state again (numbered a little ahead of the swarm, so that every peer takes it as the newest) and
publishes a RollbackRecord under `<run_id>_rollback`, signed exactly as the run record is: an entry whose subkey is
its writer's public key, signed with it (hivemind's RSASignatureValidator). A peer trusts only the key that signed the
run record it joined with (hivetrain.run_record.fetch_run), acts once per sequence number, and skips, with one
rate-limited warning each, an entry signed by another key, of another run, or naming a state it already holds.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from pydantic.v1 import BaseModel, StrictFloat, StrictInt, StrictStr

from hivetrain.clock import WATCH_EVERY, RecordWatcher, coordinator_records
from hivetrain.record_guard import KeyRule, guard_keys, warn_skipped
from hivetrain.swarm import DHT_READ_TIMEOUT

logger = logging.getLogger(__name__)

# Rounds (swarm epochs) the rolled-back state is numbered ahead of the swarm's latest: a peer that finishes one more
# round before it sees the record is still behind it, so it takes the rolled-back state rather than its own.
ROUNDS_AHEAD = 3
ROLLBACK_TTL = 60.0  # seconds a rollback record lives unless the coordinator refreshes it (as its run record)


def rollback_key(run_id: str) -> str:
    return f"{run_id}_rollback"


class RollbackRecord(BaseModel):
    run_id: StrictStr
    sequence: StrictInt  # 1, 2, ... per run: a peer acts once on each
    epoch: StrictInt  # the swarm epoch of the best checkpoint the state comes from
    top1: StrictFloat  # that checkpoint's top-1
    round: StrictInt  # the swarm epoch (diloco: outer round) the rolled-back state carries
    reason: StrictStr  # what the coordinator saw, for the peers' line: "top-1 fall to 9.8%", "the loss turn nan"
    time: StrictFloat


def rollback_rules(run_id: str) -> list[KeyRule]:
    return [KeyRule(rollback_key(run_id), "signed", RollbackRecord)]


def publish_rollback(dht: hivemind.DHT, record: RollbackRecord, ttl: float = ROLLBACK_TTL) -> bool:
    """Store `record` under the run's rollback key, signed with this process's key as the run record is (the
    coordinator refreshes both alike). Returns hivemind's answer: that of the last node to reply."""
    guard_keys(dht, rollback_rules(record.run_id))
    return dht.store(rollback_key(record.run_id), subkey=RSASignatureValidator().local_public_key,
                     value=record.dict(), expiration_time=get_dht_time() + ttl)


def read_rollback(dht: hivemind.DHT, run_id: str, coordinator_key: bytes,
                  timeout: float = DHT_READ_TIMEOUT) -> Optional[RollbackRecord]:
    """The coordinator's newest rollback record of run `run_id`, if any (hivetrain.clock.coordinator_records)."""
    records = coordinator_records(dht, rollback_rules(run_id)[0], run_id, coordinator_key, timeout)
    return max(records, key=lambda record: record.sequence, default=None)


class RollbackWatcher(RecordWatcher[RollbackRecord]):
    """A peer's watch: a thread reads the rollback key every `every` seconds; `take(round_)` hands the training loop a
    record to act on, once per sequence number. A record whose state is not ahead of the peer's round is stale (the
    peer joined after it, or already holds a newer state): skipped with a warning."""

    def __init__(self, dht: hivemind.DHT, run_id: str, coordinator_key: bytes, every: float = WATCH_EVERY):
        super().__init__(lambda: read_rollback(dht, run_id, coordinator_key), "rollback-watcher", every)
        self.run_id = run_id
        self._acted_on = 0  # the last sequence number taken or skipped
        self._taking = threading.Lock()

    def take(self, round_: int) -> Optional[RollbackRecord]:
        """The newest record not yet acted on, when its state is ahead of `round_` (this peer's swarm epoch)."""
        with self._taking:
            record = self.latest
            if record is None or record.sequence <= self._acted_on:
                return None
            self._acted_on = record.sequence
        if record.round <= round_:
            warn_skipped(rollback_key(self.run_id), "stale",
                         f"rollback {record.sequence} is to swarm epoch {record.round}, this peer is at {round_}")
            return None
        return record


def wait_for_state(load, current_round, record: RollbackRecord, deadline_seconds: float = 30.0) -> bool:
    """Download the rolled-back state (`load()`, asking the coordinator alone: CoordinatorWatch.holder) until this
    peer's round (`current_round()`) reaches it; a download may fail, and is tried again. True when reached."""
    deadline = time.monotonic() + deadline_seconds
    while True:
        load()
        if current_round() >= record.round:
            return True
        if time.monotonic() > deadline:
            logger.warning(f"Could not load the rolled-back state of swarm epoch {record.round} within"
                           f" {deadline_seconds:.0f} s: training on from swarm epoch {current_round()}")
            return False
        time.sleep(1.0)
