"""Every record a role reads from the DHT is untrusted input: this module vets them (reaching into the DHT node's
storage through hivetrain.hivemind_internals.dht).

Anyone who can reach one peer of a run can store anything under any key, and hivemind 1.1.12 leaves these doors open:

- A node checks a record only against the validators it has *at that moment*, and never checks what it already holds
  when it reads. A joiner adds a key's schema only once it knows the run (hivemind's ProgressTracker adds its own just
  before its first read), but records reach its node from the moment it joins: every store under a key goes to the
  nodes nearest to it (in a small swarm, all of them), and Kademlia hands a newly met node the records it is now
  among the nearest to hold. So a malformed entry under `<run_id>_progress` lands unchecked in a joiner's storage,
  and ProgressTracker's first read parses it with `LocalTrainingProgress.parse_obj` without a try: the joiner dies
  with a pydantic ValidationError, for as long as some node holds the entry and hands it on.
- Expirations have no cap. A plain value (no subkey) under a key whose entries are per-peer subkeys wins every
  `latest=True` read once it expires later than them, and a node holding it refuses new subkeys under that key: one
  store with an expiration a year ahead stops hivemind's matchmaking (`<prefix>.0b`) and state downloads
  (`<prefix>.all_averagers`) for a year.
- A reader strips anything that looks like a signature from every value's bytes before decoding them; an unsigned
  entry with such text inside no longer decodes, and hivemind's read of the key never returns (its future is never
  resolved): ProgressTracker's first read, matchmaking and state downloads hang on it.
- hivemind's own averaging keys have no schema at all.

Three defences, all here:

1. RecordGuard, a record validator for the run's keys, refuses on arrival what no reader could use: oversized values,
   expirations beyond a sane horizon, plain values under per-peer keys, entries without a valid owner signature or of
   the wrong shape. `guard_run_keys` (hivetrain.run_record) adds it once a process knows its run, and drops from the
   node's own storage whatever the node took in before it had the guard.
2. The readers (hivetrain.swarm.read_records, VettedProgressTracker for hivemind's tracker) skip entries they cannot
   use, one by one, whatever the node let in.
3. Each skipped record is reported with a rate-limited warning: once per key and reason per WARN_EVERY seconds, with
   the count of those skipped in between, not one line per read every few seconds.

What this does not stop: a well-formed record, validly signed by its writer's own key, that lies (a peer claiming a
huge epoch, a run record claiming to come from the coordinator); and hivemind's unsigned averaging entries, which
anyone may write for any peer ID. Those need signed, bound identities, not shape checks.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import time
import weakref
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional

import hivemind
from cryptography.hazmat.primitives import serialization
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.optim.progress_tracker import LocalTrainingProgress
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer, ValueWithExpiration, get_dht_time
from pydantic.v1 import BaseModel

from hivetrain.hivemind_internals import (SIGNATURE_RE, SIGNED_SUBKEY_RE, HookedProgressTracker, progress_subkey,
                                          signature_checker)
from hivetrain.hivemind_internals.dht import RESERVED_SUBKEYS, drop_held_records, key_id, node_validator

logger = logging.getLogger(__name__)

WARN_EVERY = 60.0  # seconds between two warnings about the same key and reason
# No record of a run is meant to live long: HiveTrain's expire 30-60 s after their last refresh, hivemind's progress
# after 60 s, its state-sharing declarations after 30 s, its matchmaking ones at the end of an averaging round. A record
# that expires further ahead than this pins its key: it is ignored.
FAR_FUTURE = 600.0  # seconds ahead of now
MAX_RECORD_BYTES = 64 * 1024  # a run record is about 1 KiB with its signature, a progress or metrics record less
INT64_MAX = 2**63 - 1  # the metrics store (SQLite) holds no larger integer

_SIGNATURE_CHECK = signature_checker()


class RateLimitedWarnings:
    """Warns about a skipped record once per (key, reason) per `every` seconds; the next warning after a quiet spell
    says how many were skipped meanwhile. Each process has its own (hivemind validates in the DHT's process). No lock:
    hivemind forks its processes from threaded ones, and two threads racing here cost at most one extra line."""

    def __init__(self, every: float = WARN_EVERY):
        self.every = every
        self._last: dict[tuple[str, str], float] = {}
        self._unreported: dict[tuple[str, str], int] = {}

    def skipped(self, key: str, reason: str, detail: str = "") -> None:
        now, which = time.monotonic(), (key, reason)
        last = self._last.get(which)
        if last is not None and now - last < self.every:
            self._unreported[which] = self._unreported.get(which, 0) + 1
            return
        self._last[which] = now
        unreported = self._unreported.pop(which, 0)
        since = f" ({unreported} more since the last warning)" if unreported else ""
        logger.warning(f"Skipping a record under {key}: {reason}{f': {detail}' if detail else ''}{since}")


skip_warnings = RateLimitedWarnings()


def warn_skipped(key: str, reason: str, detail: str = "") -> None:
    """Report a record under `key` that a reader skipped (rate-limited: see RateLimitedWarnings)."""
    skip_warnings.skipped(key, reason, detail)


def _one_line(error: Exception, limit: int = 300) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[:limit] + "..."


def parse_entry(schema: type[BaseModel], value: Any) -> tuple[Optional[BaseModel], Optional[str]]:
    """`value` as a `schema` record, or why it is not one. Beyond the schema, numbers must be usable: finite floats
    (an infinite rate makes hivemind's ETA NaN), integers that fit in 64 bits (SQLite's limit)."""
    try:
        record = schema.parse_obj(value)
    except Exception as e:  # pydantic's ValidationError, or a TypeError on a value that is not a mapping
        return None, _one_line(e)
    for name, field in record.dict().items():
        if isinstance(field, float) and not math.isfinite(field):
            return None, f"{name} is {field}"
        if isinstance(field, int) and not isinstance(field, bool) and abs(field) > INT64_MAX:
            return None, f"{name} does not fit in 64 bits"
    return record, None


def owner_subkey_problem(subkey: Any) -> Optional[tuple[str, str]]:
    """Why `subkey` is not a signed entry's, as (reason, detail), or None. A signed entry's subkey is its owner's key
    and nothing else: hivemind signs any subkey that holds the key, so one key could keep any number of entries (each
    a peer to count, a row in the store) by varying what follows it."""
    if not isinstance(subkey, bytes) or not SIGNED_SUBKEY_RE.search(subkey):
        return "unsigned", "its subkey names no owner key"
    if not SIGNED_SUBKEY_RE.fullmatch(subkey):
        return "malformed", "its subkey holds more than its owner key (one entry per key)"
    return None


def signer_peer_id(subkey: bytes) -> Optional[str]:
    """The libp2p peer ID (base58) of the RSA key a signed subkey names, or None when it names none. A peer ID is the
    sha256 multihash of the key's libp2p protobuf form, so the peer whose address ends in that ID holds the key."""
    match = SIGNED_SUBKEY_RE.fullmatch(subkey) if isinstance(subkey, bytes) else None
    if match is None:
        return None
    try:
        public_key = serialization.load_ssh_public_key(match.group(1))
        der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    except (ValueError, TypeError):  # not an OpenSSH key, or not one DER can hold
        return None
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.RSA, data=der).SerializeToString()
    return PeerID(b"\x12\x20" + hashlib.sha256(encoded).digest()).to_base58()


def _expiration_problem(expiration_time: float, now: float) -> Optional[str]:
    if expiration_time > now + FAR_FUTURE:
        return f"expires in {(expiration_time - now) / 86400:.1f} days"
    return None


def usable_entries(key: str, value: Any, schema: type[BaseModel]) -> list[tuple[Any, ValueWithExpiration, BaseModel]]:
    """The entries of a per-peer key as a DHT read returned them (`found.value`), each parsed with `schema`, as
    (subkey, entry, record). Skipped with a warning: a plain value where per-peer entries belong, an entry whose
    subkey names no owner key (so nobody signed it), one expiring beyond FAR_FUTURE, one over MAX_RECORD_BYTES, one
    that does not parse. A reader cannot check signatures (hivemind strips them): RecordGuard does, on arrival.
    Skipped silently: cleared entries (None: their owner left)."""
    if value is None:
        return []
    if not isinstance(value, dict):
        warn_skipped(key, "a plain value where per-peer entries belong", type(value).__name__)
        return []
    now = get_dht_time()
    usable = []
    for subkey, entry in value.items():
        if not isinstance(entry, ValueWithExpiration):
            warn_skipped(key, "malformed", f"an entry of type {type(entry).__name__}")
            continue
        if entry.value is None:
            continue
        if problem := owner_subkey_problem(subkey):
            warn_skipped(key, *problem)
            continue
        if problem := _expiration_problem(entry.expiration_time, now):
            warn_skipped(key, "expires too far ahead", problem)
            continue
        if (size := len(MSGPackSerializer.dumps(entry.value))) > MAX_RECORD_BYTES:
            warn_skipped(key, "too large", f"{size} bytes")
            continue
        record, problem = parse_entry(schema, entry.value)
        if problem is not None:
            warn_skipped(key, "malformed", problem)
            continue
        usable.append((subkey, entry, record))
    return usable


@dataclass(frozen=True)
class KeyRule:
    """What may be stored under one DHT key. `kind`: "signed" (per-peer entries, each in a subkey with its owner's
    public key, signed by it, a `schema` record or None), "state_sharing" (hivemind's `<prefix>.all_averagers`: peer ID
    subkeys, a number or None) or "matchmaking" (hivemind's `<prefix>.0b...`: peer ID subkeys, a bool)."""

    key: str
    kind: str
    schema: Optional[type[BaseModel]] = None

    def problem(self, record: DHTRecord, now: float) -> Optional[tuple[str, str]]:
        """Why `record` cannot be used, as (reason, detail), or None when it can."""
        if record.subkey in RESERVED_SUBKEYS:
            return "a plain value where per-peer entries belong", ""
        if len(record.value) > MAX_RECORD_BYTES:
            return "too large", f"{len(record.value)} bytes"
        if problem := _expiration_problem(record.expiration_time, now):
            return "expires too far ahead", problem
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
        except Exception as e:
            return "malformed", f"undecodable subkey ({_one_line(e, 80)})"
        if self.kind == "signed":
            return self._signed_problem(record, subkey)
        if not _is_peer_id(subkey):
            return "malformed", "its subkey is not a peer ID"
        if SIGNATURE_RE.search(record.value):  # hivemind's entries are unsigned: a signature here is forged text
            return "malformed", "a signature in an unsigned entry"
        try:
            value = MSGPackSerializer.loads(record.value)
        except Exception as e:
            return "malformed", f"undecodable value ({_one_line(e, 80)})"
        if self.kind == "state_sharing":
            usable = value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)
                                       and math.isfinite(value))
        else:
            usable = isinstance(value, bool)
        return None if usable else ("malformed", f"a value of type {type(value).__name__}")

    def _signed_problem(self, record: DHTRecord, subkey: Any) -> Optional[tuple[str, str]]:
        if problem := owner_subkey_problem(subkey):
            return problem
        try:
            signed = _SIGNATURE_CHECK.validate(record)
        except Exception:  # a public key that does not load
            signed = False
        if not signed:
            return "bad signature", "not signed by the key its subkey names"
        try:
            value = MSGPackSerializer.loads(_SIGNATURE_CHECK.strip_value(record))
        except Exception as e:
            return "malformed", f"undecodable value ({_one_line(e, 80)})"
        if value is None:
            return None  # its owner cleared it
        _, problem = parse_entry(self.schema, value)
        return None if problem is None else ("malformed", problem)


def _is_peer_id(subkey: Any) -> bool:
    # A libp2p peer ID is a multihash: sha256 (0x12) of an RSA key, or the identity hash (0x00) of a short key.
    return isinstance(subkey, bytes) and len(subkey) > 2 and subkey[0] in (0x00, 0x12) and subkey[1] == len(subkey) - 2


class RecordGuard(RecordValidatorBase):
    """A hivemind record validator that refuses, with a rate-limited warning, records under the guarded keys that a
    reader could not use (KeyRule.problem). hivemind runs it on every record this node is asked to store and every
    record another node returns to it; keys without a rule pass."""

    def __init__(self, rules: list[KeyRule]):
        self.rules = {key_id(rule.key): rule for rule in rules}

    def validate(self, record: DHTRecord) -> bool:
        rule = self.rules.get(record.key)
        if rule is None:
            return True
        problem = rule.problem(record, get_dht_time())
        if problem is None:
            return True
        warn_skipped(rule.key, *problem)
        return False

    @property
    def priority(self) -> int:
        # Before RSASignatureValidator (10) and the schema validators (0), which refuse without saying why: the guard
        # sees the signed value and reports the reason.
        return 20

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, RecordGuard):
            return False
        self.rules.update(other.rules)
        return True


_added: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # DHT -> names of the validators added to it


def add_validators_once(dht: hivemind.DHT, name: str, validators: list[RecordValidatorBase]) -> bool:
    """dht.add_validators, once per DHT and `name`; True when added now. hivemind merges a schema validator into the
    one before it by appending its schema: a reader adding its schema before every read made each refused record cost
    one failed parse per read done since the process started."""
    added = _added.setdefault(dht, set())
    if name in added:
        return False
    dht.add_validators(validators)
    added.add(name)
    return True


def guard_keys(dht: hivemind.DHT, rules: list[KeyRule], timeout: float = 10.0) -> int:
    """Add a RecordGuard for `rules` to this DHT node, then drop from its storage and cache what its validators now
    refuse (taken in before it had them). Returns how many records were dropped. Keys already guarded on this DHT
    are left alone, so readers may call it before every read."""
    rules = [rule for rule in rules if f"guard {rule.key}" not in _added.get(dht, ())]
    if not rules:
        return 0
    dht.add_validators([RecordGuard(rules)])
    _added.setdefault(dht, set()).update(f"guard {rule.key}" for rule in rules)
    key_ids = [key_id(rule.key) for rule in rules]
    try:
        return dht.run_coroutine(partial(_drop_refused_records, key_ids), return_future=True).result(timeout=timeout)
    except Exception as e:  # the DHT is shutting down: nothing left to protect
        logger.debug(f"Could not clean the DHT node's storage: {type(e).__name__}: {e}")
        return 0


async def _drop_refused_records(key_ids: list[bytes], _dht: hivemind.DHT, node) -> int:
    """Inside the DHT's process: re-validate what the node holds under `key_ids` with its current validators, and
    remove what they refuse. A node serves its own storage to its own reads unchecked, and hands it on to the nodes it
    meets."""
    validator = node_validator(node)

    def valid(record: DHTRecord) -> bool:
        try:
            return validator.validate(record)
        except Exception:  # a validator choking on the record: it cannot be used either
            return False

    return drop_held_records(node, key_ids, valid)


def usable_progress(key: str, metadata: Any, epoch_bound: Optional[int] = None, own: Optional[bytes] = None) -> dict:
    """hivemind's progress entries (a DHT read of `<run_id>_progress`) without those usable_entries skips, nor, with
    `epoch_bound`, those claiming a later epoch (but this peer's own entry, under `own`)."""
    usable = {}
    for subkey, entry, record in usable_entries(key, metadata, LocalTrainingProgress):
        if epoch_bound is not None and record.epoch > epoch_bound and subkey != own:
            warn_skipped(key, "ahead of the coordinator's clock", f"epoch {record.epoch}, beyond {epoch_bound}")
            continue
        usable[subkey] = entry
    return usable


@functools.cache
def vetted(tracker_class: type[HookedProgressTracker]) -> type[HookedProgressTracker]:
    """`tracker_class` (a HookedProgressTracker) reading only usable progress entries: hivemind's parser (which parses
    each entry without a try, and runs in the constructor) gets the swarm's progress with the unusable entries
    removed, each reported by a rate-limited warning."""

    class Vetted(tracker_class):
        # The highest epoch another peer's entry may claim (hivetrain.clock.ClockWatcher.bound), None: any.
        epoch_bound: Callable[[], Optional[int]] = staticmethod(lambda: None)

        def before_parsing_progress(self, metadata: Any) -> Any:
            return super().before_parsing_progress(usable_progress(
                self.training_progress_key, metadata, self.epoch_bound(), own=progress_subkey(self)))

    Vetted.__name__ = Vetted.__qualname__ = f"Vetted{tracker_class.__name__}"
    Vetted.__doc__ = f"{tracker_class.__name__} that skips unusable progress entries (hivetrain.record_guard.vetted)."
    return Vetted


def others_epochs(tracker: HookedProgressTracker, timeout: float) -> Optional[list[int]]:
    """The epochs the other peers' usable progress entries state now, read from the DHT (a vetted tracker's own
    reads pause while its peer runs a round); an empty list once they have all withdrawn them. None when the read
    fails or takes over `timeout` seconds, or comes back without this peer's own entry (live, or cleared as it left):
    such a read may have missed the others' too: under a loaded suite a read of a record just seen came back without
    it."""
    try:  # a reply hivemind cannot decode leaves its future unresolved: never wait on it forever (swarm._read_entries)
        found = tracker.dht.get(tracker.training_progress_key, latest=True, return_future=True).result(timeout=timeout)
    except Exception:
        return None
    own = progress_subkey(tracker)
    if found is None or not isinstance(found.value, dict) or own not in found.value:
        return None
    usable = usable_progress(tracker.training_progress_key, found.value, tracker.epoch_bound(), own)
    return [LocalTrainingProgress.parse_obj(entry.value).epoch for subkey, entry in usable.items() if subkey != own]


VettedProgressTracker = vetted(HookedProgressTracker)  # what hivemind.Optimizer's tracker is in a SwarmOptimizer
