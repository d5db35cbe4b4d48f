"""The run record: the coordinator's manifest of a run, published in the DHT, and the pin that says whose to believe.

Anyone can store a validly signed record under the run key: a signature proves only that its writer holds the key
named in its subkey. What makes a record the coordinator's is that key. The coordinator signs its records with its
libp2p identity key, so the peer ID in its address (the `/p2p/Qm...` part of every join command) is the hash of the
one key a joiner believes: the join command is the pin, checked on the joiner's machine with no one's word for it.

A joiner pins the peer IDs of the initial peers it was given (or the one it names with --coordinator), takes only run
records signed by a pinned key, and obeys rollback records (hivetrain.rollback) and, in a private run, revocation
lists (hivetrain.revocation) from that key alone. A record's own fields carry no trust: its `time` only orders the
records of a coordinator the joiner already believes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import hivemind
from hivemind.dht.schema import BytesWithPublicKey, RSASignatureValidator, SchemaValidator
from hivemind.utils import get_dht_time
from hivemind.optim.progress_tracker import LocalTrainingProgress
from pydantic.v1 import BaseModel, StrictFloat, StrictStr

from hivetrain.config import RunConfig
from hivetrain.clock import clock_rules
from hivetrain.membership import member_rules
from hivetrain.record_guard import KeyRule, add_validators_once, guard_keys, signer_peer_id, warn_skipped
from hivetrain.revocation import revocation_rules
from hivetrain.rollback import rollback_rules
from hivetrain.swarm import SwarmError, read_signed_records
from hivetrain.telemetry import PeerRecord, metrics_key, progress_key

logger = logging.getLogger(__name__)

RUN_KEY = "hivetrain_run"  # one fixed key: a joiner knows only an address, not yet the run's id
RUN_RECORD_TTL = 60.0  # seconds a published manifest lives unless the coordinator refreshes it
TRUST_ANY_FLAG = "--any-coordinator"  # peers/join.py's flag that takes an unpinned run record (named in errors)


class RunManifest(BaseModel):
    """The coordinator's manifest of its run, signed, under RUN_KEY (the logbook's JSON of a finished run is
    hivetrain.run_result.RunResult)."""

    run_id: StrictStr
    config: StrictStr  # RunConfig as JSON
    fingerprint: StrictStr
    time: StrictFloat  # when its coordinator published it: orders one coordinator's records, nothing more


class _RunManifestSchema(BaseModel):
    hivetrain_run: dict[BytesWithPublicKey, Optional[RunManifest]]


@dataclass(frozen=True)
class PinnedRun:
    """A run as a joiner fetched it: its configuration, the subkey its record was signed under (the coordinator's
    public key, whose rollback records and revocation lists the joiner obeys) and the peer ID that key hashes to
    (None: not pinned)."""

    config: RunConfig
    signer: bytes
    coordinator: Optional[str]


def pinned_peer_ids(initial_peers: list[str], coordinator: Optional[str] = None) -> set[str]:
    """The peer IDs whose run records a joiner believes: `coordinator` when given, else those its initial peers'
    addresses end in."""
    if coordinator:
        return {coordinator}
    return {part.split("/")[0] for address in initial_peers for part in address.split("/p2p/")[1:]}


def publish_run_config(dht: hivemind.DHT, config: RunConfig, ttl: float = RUN_RECORD_TTL) -> bool:
    """Store the manifest under the run key, signed with this process's key (only it can overwrite its entry). A
    coordinator signs with its identity key (hivemind_internals.sign_records_with) so that joiners can pin it."""
    _add_run_record_validators(dht)
    record = RunManifest(run_id=config.run_id, config=config.to_json(), fingerprint=config.fingerprint,
                       time=time.time())
    return dht.store(RUN_KEY, subkey=RSASignatureValidator().local_public_key, value=record.dict(),
                     expiration_time=get_dht_time() + ttl)


def fetch_run(dht: hivemind.DHT, run_id: Optional[str] = None, initial_peers: list[str] = (), timeout: float = 15.0,
              coordinator: Optional[str] = None, any_coordinator: bool = False) -> PinnedRun:
    """The newest run record signed by a pinned coordinator (pinned_peer_ids), of run `run_id` when given.

    Args:
        dht: this peer's DHT node; once the run is known, its keys are guarded (record_guard.guard_run_keys).
        run_id: the run to join when the pinned coordinators publish several.
        initial_peers: the addresses the user gave: their peer IDs are the pins, unless `coordinator` is given.
        timeout: seconds to wait for a pinned record.
        coordinator: the coordinator's peer ID, for a joiner whose initial peers are other volunteers.
        any_coordinator: take the newest record whoever signed it (anyone can publish one), with a warning.
    """
    pins = pinned_peer_ids(list(initial_peers), coordinator)
    if not pins and not any_coordinator:
        raise SwarmError(f"no coordinator to believe: the initial peers name no peer ID (/p2p/...); pass"
                         f" --coordinator PEER_ID, or {TRUST_ANY_FLAG} to take any run record")
    deadline = time.monotonic() + timeout
    while True:
        records = [(record, config, signer, signer_peer_id(signer)) for record, config, signer in _read_run_records(dht)
                   if run_id is None or record.run_id == run_id]
        believed = records if any_coordinator else [r for r in records if r[3] in pins]
        if believed:
            break
        if time.monotonic() > deadline:
            which = f"run {run_id!r}" if run_id else "any run"
            if records:
                raise SwarmError(
                    f"the swarm's records for {which} are signed by none of the peers you named"
                    f" ({', '.join(sorted(pins))}): join with the coordinator's own address (its /p2p/ ID vouches for"
                    f" the run) or --coordinator PEER_ID; {TRUST_ANY_FLAG} takes a record anyone could have written")
            raise SwarmError(
                f"the swarm has no published configuration for {which} after {timeout:.0f} s: are the initial peers a"
                " HiveTrain coordinator (python coordinator/start.py) and is it still running?"
            )
        time.sleep(0.5)
    believed.sort(key=lambda r: (r[3] in pins, r[0].time), reverse=True)
    newest, config, signer, peer_id = believed[0]
    if run_id is None and len({r[0].run_id for r in believed}) > 1:
        runs = ", ".join(sorted({r[0].run_id for r in believed}))
        raise SwarmError(f"the swarm holds several runs ({runs}): choose one with --run-id")
    if peer_id not in pins:
        logger.warning(f"Run {config.run_id} comes from a record nobody vouches for ({TRUST_ANY_FLAG}): its signer"
                       f" ({peer_id}) is not a peer you named")
    # From here on this node refuses what the run's readers could not use, and forgets what it took in before.
    guard_run_keys(dht, config.run_id)
    return PinnedRun(config, signer, peer_id if peer_id in pins else None)


def run_key_rules(run_id: str) -> list[KeyRule]:
    """Every key the roles of run `run_id` read: the run manifest, the peers' metrics, hivemind's progress records, the
    coordinator's rollback record, clock and revocation list, the members' records, and the state-sharing
    declarations and matchmaking key of each of its averagers."""
    rules = [KeyRule(RUN_KEY, "signed", RunManifest), KeyRule(metrics_key(run_id), "signed", PeerRecord),
             KeyRule(progress_key(run_id), "signed", LocalTrainingProgress), *rollback_rules(run_id),
             *clock_rules(run_id), *revocation_rules(run_id), *member_rules(run_id)]
    # hivemind.Optimizer's and the coordinator's averagers, and diloco's outer state: `{run_id}_outer` is
    # hivetrain.outer_state.outer_state_prefix, not imported (a joiner imports the training stack in another thread
    # while this runs; importing torch from both could deadlock), and tests/test_hostile_records.py checks the two
    # agree.
    # HiveTrain's averagers start without group bits (hivetrain.swarm.group_matchmaking), and hivemind adds bits only to
    # a key that has some: with or without a group size cap, an averager's matchmaking key is `<prefix>.0b`, but for
    # the rounds of a robust diloco run.
    for prefix in (f"{run_id}_grad_averager", f"{run_id}_state_averager", f"{run_id}_outer"):
        rules += [KeyRule(f"{prefix}.all_averagers", "state_sharing"), KeyRule(f"{prefix}.0b", "matchmaking")]
    # A robust diloco run's rounds match under the round's last two bits (hivetrain.outer_state.OuterState._outer_step).
    rules += [KeyRule(f"{run_id}_outer.0b{bits:02b}", "matchmaking") for bits in range(4)]
    return rules


def guard_run_keys(dht: hivemind.DHT, run_id: str) -> int:
    """guard_keys for every key run `run_id` reads: call it as soon as a process knows its run."""
    return guard_keys(dht, run_key_rules(run_id))


def _add_run_record_validators(dht: hivemind.DHT) -> None:
    # The signature validator signs what this process stores and strips signatures from what it reads. hivemind
    # keeps the first one a DHT gets (and merges later ones into it): a process signs all its records with one key.
    add_validators_once(dht, "run record schema",
                        [SchemaValidator(_RunManifestSchema, allow_extra_keys=True), RSASignatureValidator()])
    guard_keys(dht, [KeyRule(RUN_KEY, "signed", RunManifest)])


def _read_run_records(dht: hivemind.DHT) -> list[tuple[RunManifest, RunConfig, bytes]]:
    """The run records in the swarm with their configurations and the subkeys they were signed under; a record whose
    configuration does not load, or does not match its fingerprint and run, is skipped with a warning."""
    _add_run_record_validators(dht)
    usable = []
    for signer, record in read_signed_records(dht, RUN_KEY, RunManifest):
        try:
            config = RunConfig.from_json(record.config)
        except Exception as e:  # JSON, or a field RunConfig refuses
            warn_skipped(RUN_KEY, "malformed", f"its configuration does not load ({type(e).__name__}: {e})")
            continue
        if (config.fingerprint, config.run_id) != (record.fingerprint, record.run_id):
            warn_skipped(RUN_KEY, "malformed", "its configuration does not match its fingerprint and run")
            continue
        usable.append((record, config, signer))
    return usable
