"""The swarm's clock: how far the swarm has got by the coordinator's count, signed by it, and the bound it sets on
what any one peer may claim.

A progress record's epoch (sync) or round (diloco) is its writer's word. One record at epoch 10^12 once made every
sync peer reload the state at each step, and set the coordinator's epoch for good. Now the coordinator counts the
swarm's epoch itself (swarm_epoch: a majority of two claims or more can move it anywhere, so a restarted coordinator
learns where the swarm is; a lone peer's claim can move it at most EPOCHS_AHEAD per look) and publishes it under
`<run_id>_clock`, signed as the run record is. Peers read it (ClockWatcher) and skip progress entries, and groupmates'
round numbers, more than EPOCHS_AHEAD beyond it, with a rate-limited warning. A peer that has no clock to read (the
coordinator is away) bounds nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Generic, Optional, TypeVar

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from pydantic.v1 import BaseModel, StrictFloat, StrictStr, conint

from hivetrain.record_guard import INT64_MAX, KeyRule, guard_keys, warn_skipped
from hivetrain.swarm import DHT_READ_TIMEOUT, read_signed_records

logger = logging.getLogger(__name__)

# Epochs (rounds) a claim may be ahead of the coordinator's count: more than an honest swarm advances between two of
# the coordinator's looks (--refresh, 10 s by default) plus a peer's read of the clock.
EPOCHS_AHEAD = 32
CLOCK_TTL = 60.0  # seconds a published clock lives unless the coordinator refreshes it (at each look)
# A clock that changed this recently (seconds) is the swarm's present: the coordinator publishes one at each look
# (--refresh, 10 s by default).
CLOCK_FRESH = 25.0
# Seconds between a peer's reads of a coordinator's record: a rollback is to be taken within 10 s of its validation.
WATCH_EVERY = 2.0

T = TypeVar("T")


def clock_key(run_id: str) -> str:
    return f"{run_id}_clock"


class ClockRecord(BaseModel):
    run_id: StrictStr
    epoch: conint(strict=True, ge=0, le=INT64_MAX)  # the swarm epoch (diloco: outer round) by the coordinator's count
    time: StrictFloat
    # The swarm epoch (diloco: round) of the state the coordinator's holder holds (0: none yet); None when it takes no
    # states (it does not validate). A last peer keeps its state up until this reaches its own (hivetrain.hand_over).
    held: Optional[conint(strict=True, ge=0, le=INT64_MAX)] = None


def clock_rules(run_id: str) -> list[KeyRule]:
    return [KeyRule(clock_key(run_id), "signed", ClockRecord)]


def swarm_epoch(previous: int, claims: list[int]) -> int:
    """The coordinator's count of the swarm's epoch, from its `previous` count and the epochs the peers claim: the
    highest of the previous count and the epoch more than half of the claims have reached, when there are two claims
    or more; with one claim, the claim if it is at most EPOCHS_AHEAD beyond the previous count. It never goes back.

    So a restarted coordinator catches up with the swarm at its first look once two peers agree; a lone peer (or
    attacker) moves it by at most EPOCHS_AHEAD per look; and a peer ahead of the others (one that trained on alone
    while cut off, whose lone epochs come fast) moves it not at all: it is the one to take the swarm's state
    (hivetrain.coordinator_watch). A lone claim beyond the bound counts for nothing: a record at epoch 10^12, stored
    alone before any volunteer joins (tests/test_takeover.py), leaves the count where it was, where taking such a
    claim as far as the bound raised the count by EPOCHS_AHEAD at every look, for good (tried, 576 after 18 looks). A
    lone writer that claims just within the bound still moves it so (docs/security.md)."""
    if len(claims) >= 2:
        ordered, agreeing = sorted(claims), len(claims) // 2 + 1
        return max(previous, ordered[len(ordered) - agreeing])
    return max([previous, *(claim for claim in claims if claim <= previous + EPOCHS_AHEAD)])


def publish_clock(dht: hivemind.DHT, run_id: str, epoch: int, held: Optional[int] = None,
                  ttl: float = CLOCK_TTL) -> bool:
    """Store the coordinator's count, and the epoch of the state it holds (ClockRecord.held), signed with this
    process's key (the coordinator's identity key)."""
    guard_keys(dht, clock_rules(run_id))
    record = ClockRecord(run_id=run_id, epoch=epoch, time=get_dht_time(), held=held)
    return dht.store(clock_key(run_id), subkey=RSASignatureValidator().local_public_key, value=record.dict(),
                     expiration_time=get_dht_time() + ttl)


def coordinator_records(dht: hivemind.DHT, rule: KeyRule, run_id: str, coordinator_key: bytes,
                        timeout: float = DHT_READ_TIMEOUT) -> list:
    """The records of run `run_id` under `rule`'s key signed by `coordinator_key` (the subkey the run record was signed
    under); entries under other keys, or naming another run, are skipped with a rate-limited warning."""
    guard_keys(dht, [rule])
    records = []
    for subkey, record in read_signed_records(dht, rule.key, rule.schema, timeout):
        if subkey != coordinator_key:
            warn_skipped(rule.key, "not signed by the run's coordinator")
        elif record.run_id != run_id:
            warn_skipped(rule.key, "malformed", f"it names run {record.run_id!r}")
        else:
            records.append(record)
    return records


def read_clock(dht: hivemind.DHT, run_id: str, coordinator_key: bytes,
               timeout: float = DHT_READ_TIMEOUT) -> Optional[ClockRecord]:
    """The coordinator's latest clock for run `run_id`, or None when there is none (coordinator_records)."""
    records = coordinator_records(dht, clock_rules(run_id)[0], run_id, coordinator_key, timeout)
    return max(records, key=lambda record: record.epoch, default=None)


class RecordWatcher(Generic[T]):
    """A thread that calls `read` every `every` seconds and keeps the latest answer that was not None."""

    def __init__(self, read: Callable[[], Optional[T]], name: str, every: float = WATCH_EVERY):
        self.read, self.every = read, every
        self._latest: Optional[T] = None
        self._changed_at = 0.0  # time.monotonic() when the latest answer last changed
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=name, daemon=True)

    def start(self) -> RecordWatcher[T]:
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                value = self.read()
            except Exception as e:  # the DHT is shutting down, or a read failed: look again later
                logger.debug(f"Could not read a coordinator's record ({self._thread.name}): {type(e).__name__}: {e}")
                value = None
            if value is not None:
                with self._lock:
                    if value != self._latest:
                        self._changed_at = time.monotonic()
                    self._latest = value
                    self._seen(value)
            self._stop.wait(self.every)

    def _seen(self, value: T) -> None:
        """Called with each answer kept, under the lock: what a subclass remembers of them."""

    @property
    def latest(self) -> Optional[T]:
        with self._lock:
            return self._latest

    def unchanged_for(self) -> float:
        """Seconds since the latest answer last changed (by this watcher's own clock: no other machine's time)."""
        with self._lock:
            return time.monotonic() - self._changed_at

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=DHT_READ_TIMEOUT + self.every)


class ClockWatcher(RecordWatcher[ClockRecord]):
    """A peer's watch on the coordinator's clock; `bound()` is the highest epoch (round) a claim may name, or None
    before the first clock was read."""

    _highest = 0  # the highest count read

    def __init__(self, dht: hivemind.DHT, run_id: str, coordinator_key: bytes, every: float = WATCH_EVERY):
        super().__init__(lambda: read_clock(dht, run_id, coordinator_key), "clock-watcher", every)

    def bound(self) -> Optional[int]:
        """From the highest count read: a restarted coordinator says 0 until it has counted the swarm again."""
        with self._lock:
            return None if self._latest is None else self._highest + EPOCHS_AHEAD

    def fresh_count(self) -> Optional[int]:
        """The coordinator's count when a new one arrived within CLOCK_FRESH seconds (the coordinator publishes one
        at each look; a peer cut off from the swarm reads the last one it had, as old as the cut) and it is no lower
        than one read before (a coordinator restarted without its count says 0 until it has counted again), or
        None."""
        latest = self.latest
        fresh = latest is not None and self.unchanged_for() < CLOCK_FRESH and latest.epoch >= self._highest
        return latest.epoch if fresh else None

    def _seen(self, value: ClockRecord) -> None:
        self._highest = max(self._highest, value.epoch)
