"""What peers tell the swarm about themselves, and how anyone reads it back.

Each peer stores one record under the run's metrics key `{run_id}_metrics`, in a subkey that is its public key: the
record is signed, so no peer can overwrite another's, and it expires unless the peer refreshes it. hivemind's own
progress records (`{run_id}_progress`) are read beside them. Both keys are untrusted input (hivetrain.record_guard):
a record a reader cannot use is refused by this node or skipped on read, with a rate-limited warning, and never stops
the reader.
"""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import dataclass
from typing import Iterable, Optional

import hivemind
from hivemind.dht.schema import BytesWithPublicKey, RSASignatureValidator, SchemaValidator
from hivemind.optim.progress_tracker import LocalTrainingProgress
from hivemind.utils import get_dht_time
from pydantic.v1 import BaseModel, StrictBool, StrictFloat, StrictStr, confloat, conint

from hivetrain.clock import swarm_epoch
from hivetrain.record_guard import INT64_MAX, KeyRule, add_validators_once, guard_keys, warn_skipped
from hivetrain.swarm import DHT_READ_TIMEOUT, read_records, read_signed_records

logger = logging.getLogger(__name__)

# Seconds a record lives: a peer that stops refreshing (killed, cut off) leaves the live view this fast; a peer that
# leaves cleanly says so in its last record at once. Refreshed three times per lifetime, from a thread of its own
# (hivetrain.roles.peers.progress), so that a peer busy in a long round does not drop out of the view.
PEER_RECORD_TTL = 15.0
PUBLISH_EVERY = 5.0  # seconds between a peer's records


class PeerRecord(BaseModel):
    peer_id: StrictStr  # base58
    name: StrictStr
    hardware: StrictStr  # "NVIDIA A100 (40 GiB)" or "Intel Xeon ... (2 cores), 24 GiB"
    client_mode: StrictBool
    epoch: conint(ge=0, strict=True)  # swarm epoch the peer is at
    samples_per_second: confloat(ge=0.0, strict=True)  # trained since its last record, per second of wall clock
    loss: Optional[StrictFloat]  # mean training loss since the last record; None before the first step or when NaN
    samples: conint(ge=0, strict=True)  # samples contributed since the peer joined
    time: StrictFloat  # unix time of the record
    # diloco runs only (None in sync runs, and from peers that predate them)
    inner_steps: Optional[conint(ge=0, strict=True)] = None  # inner steps since this peer's last outer round
    pseudo_gradient_norm: Optional[confloat(ge=0.0, strict=True)] = None  # of its pseudo-gradient in its last round
    round_bytes: Optional[conint(ge=0, strict=True)] = None  # bytes it sent in its last round (estimated)
    # wall time since its first local step, and of that the time in swarm rounds and state downloads (None before)
    train_seconds: Optional[confloat(ge=0.0, strict=True)] = None
    swarm_seconds: Optional[confloat(ge=0.0, strict=True)] = None
    # diloco: its outer rounds so far, averaged with others, alone (no one to average with), failed (None in sync runs)
    rounds_averaged: Optional[conint(ge=0, strict=True)] = None
    rounds_alone: Optional[conint(ge=0, strict=True)] = None
    rounds_failed: Optional[conint(ge=0, strict=True)] = None
    left: Optional[StrictBool] = None  # True in a leaving peer's last record: count it out now, not when it lapses


class _MetricsSchema(BaseModel):
    metrics: dict[BytesWithPublicKey, Optional[PeerRecord]]


@dataclass
class ProgressSummary:
    """hivemind's view of the swarm, from its progress records."""
    epoch: int  # the newest epoch the peers report (by the coordinator's count: see read_swarm_progress)
    peers: int  # peers with a live progress record (clients included)
    samples_accumulated: int  # toward the next epoch, summed over the peers at `epoch`


def metrics_key(run_id: str) -> str:
    return f"{run_id}_metrics"


def progress_key(run_id: str) -> str:
    """hivemind's ProgressTracker's key (its prefix is the run id)."""
    return f"{run_id}_progress"


def _add_validators(dht: hivemind.DHT, run_id: str) -> None:
    # The signature validator signs what this process stores and strips signatures from what it reads (hivemind keeps
    # the first one a DHT gets: a process signs all its records with one key). Schemas merge by key.
    schema = SchemaValidator(_MetricsSchema, allow_extra_keys=True, prefix=run_id)
    add_validators_once(dht, f"metrics schema {run_id}", [schema, RSASignatureValidator()])
    guard_keys(dht, [KeyRule(metrics_key(run_id), "signed", PeerRecord),
                     KeyRule(progress_key(run_id), "signed", LocalTrainingProgress)])


def publish_peer_record(dht: hivemind.DHT, run_id: str, record: PeerRecord, ttl: float = PEER_RECORD_TTL,
                        wait: bool = False) -> None:
    """Store this peer's record; in the background unless `wait` (a peer leaving makes sure its last one lands)."""
    _add_validators(dht, run_id)
    future = dht.store(metrics_key(run_id), subkey=RSASignatureValidator().local_public_key, value=record.dict(),
                       expiration_time=get_dht_time() + ttl, return_future=True)
    if wait:
        try:
            future.result(timeout=DHT_READ_TIMEOUT)
        except TimeoutError:
            logger.warning("Could not store this peer's last metrics record in time")


class PeerIdOwners:
    """Which signing key speaks for each peer ID: the first key seen with it. A PeerRecord's `peer_id` is its writer's
    word, and the coordinator's store keeps one row per peer ID: a volunteer claiming another's ID would overwrite its
    row (its name, its samples, its place on the leaderboard). At most `capacity` IDs are remembered, the oldest
    forgotten first."""

    def __init__(self, capacity: int = 10_000):
        self.capacity = capacity
        self._owners: dict[str, bytes] = {}

    def keep_owned(self, key: str, signed: list[tuple[bytes, PeerRecord]]) -> list[PeerRecord]:
        """The records whose peer ID is theirs (first seen with the key that signed them); the others are skipped
        with a rate-limited warning under `key`."""
        kept = []
        for signer, record in signed:
            owner = self._owners.setdefault(record.peer_id, signer)
            if owner != signer:
                warn_skipped(key, "claims another peer's ID", record.peer_id)
                continue
            kept.append(record)
        while len(self._owners) > self.capacity:
            del self._owners[next(iter(self._owners))]
        return kept


def read_peer_records(dht: hivemind.DHT, run_id: str, owners: Optional[PeerIdOwners] = None) -> list[PeerRecord]:
    """Every peer's metrics record; with `owners`, only those whose peer ID belongs to their signer."""
    _add_validators(dht, run_id)
    if owners is None:
        return read_records(dht, metrics_key(run_id), PeerRecord)
    return owners.keep_owned(metrics_key(run_id), read_signed_records(dht, metrics_key(run_id), PeerRecord))


def read_swarm_progress(dht: hivemind.DHT, run_id: str, counted: Optional[int] = None) -> ProgressSummary:
    """The swarm's progress from hivemind's records. With `counted`, the coordinator's count so far, the epoch is its
    next count (hivetrain.clock.swarm_epoch), and records claiming a later one are skipped with a warning; without
    it, the newest epoch any record claims."""
    _add_validators(dht, run_id)
    key = progress_key(run_id)
    records = read_records(dht, key, LocalTrainingProgress)
    if counted is None:
        epoch = max((r.epoch for r in records), default=0)
    else:
        epoch = swarm_epoch(counted, [r.epoch for r in records])
        if ahead := [r.epoch for r in records if r.epoch > epoch]:
            warn_skipped(key, "ahead of the swarm", f"epoch {max(ahead)}, the swarm is at {epoch}")
        records = [r for r in records if r.epoch <= epoch]
    return ProgressSummary(
        epoch=epoch,
        peers=len(records),
        samples_accumulated=bounded_sum(r.samples_accumulated for r in records if r.epoch == epoch),
    )


def bounded_sum(values: Iterable[float]) -> float:
    """A sum over peers' records that stays storable whatever the records say: integers saturate at SQLite's largest
    (each record is checked to fit, their sum is not: two records of 2**63 - 1 made the metrics store raise
    OverflowError, and the coordinator died on it at every restart while the records lived), floats at the largest
    finite one (a sum of finite rates can overflow to inf)."""
    values = list(values)
    if all(isinstance(value, int) for value in values):
        return max(-INT64_MAX, min(INT64_MAX, sum(values)))
    return max(-sys.float_info.max, min(sys.float_info.max, sum(values)))


def finite_or_none(value: Optional[float]) -> Optional[float]:
    return value if value is not None and math.isfinite(value) else None


def describe_hardware(device: str) -> str:
    """What a peer trains on, for the peers table: the GPU when it uses one, else the CPU; and the memory."""
    import psutil
    import torch

    from hivetrain.run_result import cpu_name

    if device == "cuda" and torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(torch.cuda.current_device())
        return f"{properties.name} ({properties.total_memory / 2**30:.0f} GiB)"
    return f"{cpu_name()}, {psutil.virtual_memory().total / 2**30:.0f} GiB"
