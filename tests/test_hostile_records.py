"""Every DHT key the run reads is untrusted input: a plain hivemind process that knows one peer's address stores
hostile records under each key, and no reader stops, stalls or takes them for real.

Real hivemind DHTs on loopback, no training. The attacker is a hivemind.DHT that refuses nothing (no schema, no
signature check); it signs an entry only where the shape needs one, with its own key or, forged, with another's.
"""

import dataclasses
import gc
import logging
import math
import os
import re
import sys
import time
from collections import Counter
from functools import partial

import hivemind
import pydantic.v1 as pydantic
import pytest
import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.optim.progress_tracker import LocalTrainingProgress, ProgressTracker
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from conftest import publisher_identity, start_coordinator
from hivetrain.roles.coordinator.swarm_monitor import SwarmMonitor
from hivetrain.config import get_preset
from hivetrain.round_schedule import RoundTracker
from hivetrain.metrics_store import MetricsReader, MetricsWriter
from hivetrain.outer_state import outer_state_prefix
from hivetrain.record_guard import INT64_MAX, RateLimitedWarnings, VettedProgressTracker, usable_entries, vetted
from hivetrain.run_record import RUN_KEY, fetch_run, guard_run_keys, publish_run_config
from hivetrain.swarm_optimizer import SwarmOptimizer
from hivetrain.swarm import read_records
from hivetrain.telemetry import PeerRecord, metrics_key, progress_key, publish_peer_record, read_peer_records, \
    read_swarm_progress

# hivemind's ProgressTracker.__del__ fails on a tracker whose constructor raised (the reproduction below), whenever
# the garbage collector gets to it.
pytestmark = pytest.mark.filterwarnings("ignore:Exception ignored in. <function ProgressTracker.__del__")

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
YEAR = 365 * 86400.0
MEGABYTE = 1 << 20
ATTACKER_KEY = RSAPrivateKey()  # the attacker's own signing key (not this process's, which the honest nodes use)
GUARD_LOGGER = "hivetrain.record_guard"


def owner_subkey(key: RSAPrivateKey) -> bytes:
    return RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", key.get_public_key().to_bytes())


class HostileSigner(RecordValidatorBase):
    """The attacker's only validator: it refuses nothing, and signs each entry whose subkey names an owner key in
    `signers` with the key given for it: the owner's own (a valid signature) or the attacker's (a forgery)."""

    def __init__(self, signers: dict[bytes, RSAPrivateKey]):
        self.signers = signers

    def validate(self, record: DHTRecord) -> bool:
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        for owner, key in self.signers.items():
            if owner in record.subkey:
                signature = key.sign(MSGPackSerializer.dumps(dataclasses.astuple(record)))
                return record.value + RSASignatureValidator.SIGNATURE_FORMAT.replace(b"_value_", signature)
        return record.value


def start_dht(*peers: hivemind.DHT, validators=(), identity_path=None) -> hivemind.DHT:
    initial = [str(a) for dht in peers for a in dht.get_visible_maddrs()]
    return hivemind.DHT(initial_peers=initial, host_maddrs=LOOPBACK, record_validators=list(validators),
                        identity_path=identity_path, start=True)


def start_attacker(initial_peers: list[str], victim: bytes) -> hivemind.DHT:
    """A plain hivemind process that knows only `initial_peers`; `victim` is the owner subkey it forges."""
    signer = HostileSigner({owner_subkey(ATTACKER_KEY): ATTACKER_KEY, victim: ATTACKER_KEY})
    return hivemind.DHT(initial_peers=initial_peers, host_maddrs=LOOPBACK, record_validators=[signer], start=True)


def averager_keys(run_id: str) -> dict[str, str]:
    """hivemind's own keys of the run's averagers: state-sharing declarations and matchmaking."""
    keys = {}
    for prefix in (f"{run_id}_grad_averager", f"{run_id}_state_averager", outer_state_prefix(run_id)):
        keys[f"{prefix}.all_averagers"], keys[f"{prefix}.0b"] = "state_sharing", "matchmaking"
    keys.update({f"{outer_state_prefix(run_id)}.0b{bits:02b}": "matchmaking" for bits in range(4)})  # robust rounds
    return keys


# The field that Padded makes huge in a well-formed record of each kind: it stays well-formed (JSON whitespace in the
# configuration, a long name, a long peer ID).
PADDED_FIELD = {"run": "config", "metrics": "name", "progress": "peer_id"}


def well_formed(kind: str, run_id: str, victim_peer_id: str) -> dict:
    """A record a reader would believe, from the attacker: a run record with another learning rate (claiming to come
    from the coordinator, newer than its own), a peer named 'hostile', a peer at epoch 7."""
    if kind == "run":
        config = get_preset("demo").replace(run_id=run_id)
        config = config.replace(optim=dataclasses.replace(config.optim, lr=config.optim.lr * 10))
        return dict(run_id=run_id, config=config.to_json(), fingerprint=config.fingerprint,
                    coordinator=victim_peer_id, time=time.time() + 1.0)
    if kind == "metrics":
        return PeerRecord(peer_id="QmHostile", name="hostile", hardware="?", client_mode=False, epoch=7,
                          samples_per_second=1e3, loss=0.1, samples=10**6, time=time.time()).dict()
    return LocalTrainingProgress(peer_id=b"QmHostile", epoch=7, samples_accumulated=10**6,
                                 samples_per_second=1e3, time=get_dht_time(), client_mode=False).dict()


@dataclasses.dataclass
class Padded:
    """A value made `pad` bytes longer in `field` (None: the value is a string) once inside the attacker's DHT process.
    hivemind's pipe to that process takes no message of a megabyte (BlockingIOError in DHT._run), so a plain process
    builds its oversized records where its node runs, as any attacker would."""

    value: object
    field: object = None
    pad: int = MEGABYTE

    def expand(self):
        if self.field is None:
            return self.value + "x" * self.pad
        value = dict(self.value)
        value[self.field] = value[self.field] + (b"x" if isinstance(value[self.field], bytes) else " ") * self.pad
        return value


async def _store_in_node(key, subkey, value, expiration: float, _dht, node) -> bool:
    value = value.expand() if isinstance(value, Padded) else value
    return bool(await node.store(key, value, expiration, subkey=subkey))


# A string with what looks like a signature inside: a reader strips it from the value's bytes before decoding them,
# the string's length no longer matches, and hivemind's read never returns (its future is never resolved).
SIGNATURE_TEXT = "look[signature:c2lnbmVk]here"


def fake_peer_id() -> bytes:
    return b"\x12\x20" + os.urandom(32)  # a sha256 multihash, as a libp2p peer ID of nobody


def hostile_stores(shape: str, run_id: str, victim: bytes, victim_peer_id: str) -> list[tuple]:
    """(key, subkey, value, expiration) the attacker stores for `shape` under every key run `run_id` reads.
    subkey None: a plain value (no subkey)."""
    now = get_dht_time()
    signed = {RUN_KEY: "run", metrics_key(run_id): "metrics", progress_key(run_id): "progress"}
    own = owner_subkey(ATTACKER_KEY)
    stores = []
    for key, kind in signed.items():
        if shape == "malformed":  # wrong types, strings where numbers go, missing fields
            stores.append((key, own, {"epoch": "lots", "name": 5, "time": "now"}, now + 30))
        elif shape == "not finite":
            record = well_formed(kind, run_id, victim_peer_id)
            record["samples_per_second" if kind != "run" else "time"] = float("inf")
            stores.append((key, own, record, now + 30))
        elif shape == "unsigned":
            stores.append((key, b"intruder", well_formed(kind, run_id, victim_peer_id), now + 30))
        elif shape == "forged":
            stores.append((key, victim, well_formed(kind, run_id, victim_peer_id), now + 45))
        elif shape == "oversized":
            stores.append((key, own, Padded(well_formed(kind, run_id, victim_peer_id), PADDED_FIELD[kind]), now + 30))
        elif shape == "far future":
            stores.append((key, own, well_formed(kind, run_id, victim_peer_id), now + YEAR))
        elif shape == "plain value":
            stores.append((key, None, "pinned", now + YEAR))
        elif shape == "undecodable":  # unsigned, so hivemind's signature check lets it through
            stores.append((key, b"intruder", SIGNATURE_TEXT, now + 30))
    for key, kind in averager_keys(run_id).items():
        value = 1e9 if kind == "state_sharing" else True  # first in line for state downloads; looking for a group
        if shape == "malformed":
            stores.append((key, b"not a peer", "lots", now + 30))
        elif shape == "not finite" and kind == "state_sharing":
            stores.append((key, fake_peer_id(), float("inf"), now + 30))
        elif shape == "oversized":
            stores.append((key, fake_peer_id(), Padded("x"), now + 30))
        elif shape == "far future":
            stores.append((key, fake_peer_id(), value, now + YEAR))
        elif shape == "plain value":
            stores.append((key, None, "pinned", now + YEAR))
        elif shape == "undecodable":
            stores.append((key, fake_peer_id(), SIGNATURE_TEXT, now + 30))
    return stores


def attack(attacker: hivemind.DHT, stores: list[tuple], timeout: float = 30.0) -> None:
    for key, subkey, value, expiration in stores:
        attacker.run_coroutine(partial(_store_in_node, key, subkey, value, expiration),
                               return_future=True).result(timeout=timeout)


# What a reader that has no guard yet says when it skips each shape under the progress key (a forged entry looks
# like its victim's to such a reader: only a node with the guard checks signatures).
READER_REASON = {"malformed": "malformed", "not finite": "malformed", "unsigned": "unsigned",
                 "oversized": "too large", "far future": "expires too far ahead",
                 "plain value": "a plain value where per-peer entries belong"}
SHAPES = [*READER_REASON, "forged", "undecodable"]


def skip_warnings(caplog, key: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == GUARD_LOGGER and r.getMessage().startswith(f"Skipping a record under {key}:")]


class HonestPeer:
    """A node that knows the run and publishes what a coordinator and a peer would: the run record, a metrics record,
    a progress record, and its averagers' declarations."""

    def __init__(self, run_id: str):
        self.config = get_preset("demo").replace(run_id=run_id)
        self.dht = start_dht(identity_path=publisher_identity())
        guard_run_keys(self.dht, run_id)
        self.addresses = [str(a) for a in self.dht.get_visible_maddrs()]
        assert publish_run_config(self.dht, self.config)
        publish_peer_record(self.dht, run_id, PeerRecord(
            peer_id=self.dht.peer_id.to_base58(), name="honest", hardware="test CPU", client_mode=False, epoch=0,
            samples_per_second=10.0, loss=0.5, samples=32, time=time.time()), wait=True)
        progress = LocalTrainingProgress(peer_id=self.dht.peer_id.to_bytes(), epoch=0, samples_accumulated=32,
                                         samples_per_second=10.0, time=get_dht_time(), client_mode=False)
        assert self.dht.store(progress_key(run_id), progress.dict(), expiration_time=get_dht_time() + 60,
                              subkey=RSASignatureValidator().local_public_key)
        for key, kind in averager_keys(run_id).items():
            assert self.dht.store(key, 1.0 if kind == "state_sharing" else True, expiration_time=get_dht_time() + 60,
                                  subkey=self.dht.peer_id.to_bytes())


@pytest.mark.parametrize("shape", SHAPES)
def test_readers_skip_each_hostile_shape_under_every_key(shape, caplog, cleanup):
    run_id = f"hostile-{shape.replace(' ', '-')}"
    honest = HonestPeer(run_id)
    cleanup.append(honest.dht)
    # A peer whose node is up but that does not know the run yet: it takes in whatever it is sent.
    joiner = start_dht(honest.dht)
    cleanup.append(joiner)
    attacker = start_attacker(honest.addresses, victim=RSASignatureValidator().local_public_key)
    cleanup.append(attacker)
    attack(attacker, hostile_stores(shape, run_id, RSASignatureValidator().local_public_key,
                                    honest.dht.peer_id.to_base58()))

    # hivemind's progress tracker, vetted, on what that node holds: it starts, and counts no hostile peer. (Not on an
    # undecodable entry: hivemind's read of it never returns, and only the guard below keeps it out.)
    caplog.set_level(logging.WARNING, logger=GUARD_LOGGER)
    if shape != "undecodable":
        tracker = VettedProgressTracker(joiner, run_id, target_batch_size=64, start=False)
        assert tracker.global_progress.num_peers <= 1 and tracker.global_progress.epoch == 0
        for _ in range(3):  # the monitor's reads, every few seconds
            assert all(r.epoch == 0 for r in read_records(joiner, progress_key(run_id), LocalTrainingProgress))
    if shape in READER_REASON:
        warned = skip_warnings(caplog, progress_key(run_id))
        assert len(warned) == 1 and READER_REASON[shape] in warned[0], warned

    # As a joiner does: fetch the run's configuration. From then on its node refuses what it cannot use and has
    # forgotten what it took in; every reader gets exactly the honest records.
    assert fetch_run(joiner, run_id, initial_peers=honest.addresses, timeout=10).config == honest.config
    assert [r.name for r in read_peer_records(joiner, run_id)] == ["honest"]
    assert read_swarm_progress(joiner, run_id).peers == 1
    assert ProgressTracker(joiner, run_id, target_batch_size=64, start=False).global_progress.num_peers == 1
    for key in averager_keys(run_id):
        found = joiner.get(key, latest=True)
        assert found is not None and set(found.value) == {honest.dht.peer_id.to_bytes()}, (key, found)
    # A node holding a plain value under a key refuses new entries there: the guarded nodes hold none, and take them.
    # (DHT.store's answer is that of the last node to reply, the attacker's maybe: read what the honest node holds.)
    key = f"{run_id}_grad_averager.0b"
    joiner.store(key, True, expiration_time=get_dht_time() + 30, subkey=joiner.peer_id.to_bytes())
    assert set(honest.dht.get(key, latest=True).value) == {honest.dht.peer_id.to_bytes(), joiner.peer_id.to_bytes()}


def test_warnings_are_rate_limited_per_key_and_reason(caplog):
    caplog.set_level(logging.WARNING, logger=GUARD_LOGGER)
    warnings = RateLimitedWarnings(every=0.5)
    for _ in range(3):
        warnings.skipped("k_progress", "malformed", "epoch is not an integer")
        warnings.skipped("k_progress", "unsigned")
        warnings.skipped("k_metrics", "malformed")
    time.sleep(0.6)
    warnings.skipped("k_progress", "malformed", "epoch is not an integer")
    assert [r.getMessage() for r in caplog.records if r.name == GUARD_LOGGER] == [
        "Skipping a record under k_progress: malformed: epoch is not an integer",
        "Skipping a record under k_progress: unsigned",
        "Skipping a record under k_metrics: malformed",
        "Skipping a record under k_progress: malformed: epoch is not an integer (2 more since the last warning)",
    ]


def test_the_trackers_wired_with_vetting_start_among_hostile_progress(cleanup):
    """hivemind.Optimizer's tracker (through its factory method) and diloco's RoundTracker, vetted, on a node that
    holds a malformed and an unsigned progress entry: they start, and count the honest peer only."""
    run_id = "hostile-trackers"
    honest = HonestPeer(run_id)
    cleanup.append(honest.dht)
    joiner = start_dht(honest.dht)
    cleanup.append(joiner)
    attacker = start_attacker(honest.addresses, victim=RSASignatureValidator().local_public_key)
    cleanup.append(attacker)
    for shape in ("malformed", "unsigned"):
        attack(attacker, [store for store in hostile_stores(shape, run_id, RSASignatureValidator().local_public_key,
                                                            honest.dht.peer_id.to_base58())
                          if store[0] == progress_key(run_id)])

    rounds = vetted(RoundTracker)(joiner, run_id, samples_per_peer=64, start=False)
    # The round's target counts the peers in the records: the honest one only.
    assert (rounds.global_progress.num_peers, rounds.target_batch_size) == (1, 64)

    model = torch.nn.Linear(2, 1)
    optimizer = SwarmOptimizer(dht=joiner, run_id=run_id, params=model.parameters(), target_batch_size=64,
                              batch_size_per_step=8, optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    cleanup.insert(2, optimizer)  # shut down before its DHT (cleanup goes in reverse)
    assert type(optimizer.tracker) is VettedProgressTracker
    assert optimizer.tracker.global_progress.num_peers == 1


def test_the_coordinator_and_a_joiner_outlast_every_shape(tmp_path, spawn, cleanup, takeover_rows):
    """The reported case: a plain hivemind process stores hostile records under every key the coordinator's run reads.
    A joiner that has not learnt the run yet holds them; hivemind's own tracker dies on them (the reported pydantic
    ValidationError) until the joiner fetches the run's configuration, which guards its node."""
    coordinator, addresses = start_coordinator(spawn, tmp_path, "--preset", "demo", "--validate-every", "0",
                                               "--refresh", "1")
    fingerprint = coordinator.wait_for(r"fingerprint (\w+),", timeout=5).group(1)
    coordinator.wait_for(r"^swarm epoch", timeout=60)  # its first look at the swarm follows its first run record
    run_id = get_preset("demo").run_id
    joiner = hivemind.DHT(initial_peers=addresses, host_maddrs=LOOPBACK, start=True)
    cleanup.append(joiner)
    reader = start_dht(joiner, validators=[RSASignatureValidator()])  # to learn the coordinator's owner subkey
    cleanup.append(reader)
    victim = next(iter(reader.get(RUN_KEY, latest=True).value))
    coordinator_id = addresses[0].split("/p2p/")[1]
    attacker = start_attacker(addresses, victim=victim)
    cleanup.append(attacker)
    attacked = len(coordinator.lines)
    attack(attacker, hostile_stores("malformed", run_id, victim, coordinator_id))
    with pytest.raises(pydantic.ValidationError) as crash:
        ProgressTracker(joiner, run_id, target_batch_size=64, start=False)
    del crash  # its traceback holds the half-built tracker: let its __del__ fail here, under this module's filter
    gc.collect()
    for shape in SHAPES[1:]:
        attack(attacker, hostile_stores(shape, run_id, victim, coordinator_id))
    config = fetch_run(joiner, initial_peers=addresses, timeout=10).config
    assert config.fingerprint == fingerprint and config.optim == get_preset("demo").optim
    assert ProgressTracker(joiner, run_id, target_batch_size=64, start=False).global_progress.num_peers == 0

    # The coordinator goes on looking at the swarm, and says once what it refused.
    status = re.compile(r"^swarm epoch \d+ \|")
    deadline = time.monotonic() + 30
    while sum(bool(status.match(line)) for line in coordinator.lines[attacked:]) < 4:
        assert coordinator.popen.poll() is None, coordinator.lines[-20:]
        assert time.monotonic() < deadline, coordinator.lines[-20:]
        time.sleep(0.2)
    assert coordinator.popen.poll() is None
    warned = Counter(m.groups() for line in coordinator.lines
                     if (m := re.search(r"Skipping a record under (\S+): ([^:(]+?)(?::|$| \()", line)))
    assert all(count == 1 for count in warned.values()), warned
    expected = {(key, reason) for key in (RUN_KEY, metrics_key(run_id), progress_key(run_id))
                for reason in ("malformed", "unsigned", "bad signature", "too large", "expires too far ahead",
                               "a plain value where per-peer entries belong")}
    assert expected <= set(warned), sorted(expected - set(warned))
    assert not any("Traceback" in line for line in coordinator.lines), coordinator.lines
    looks = sum(bool(status.match(line)) for line in coordinator.lines[attacked:])
    takeover_rows.add(4, f"records of {len(SHAPES)} hostile shapes under every key the run reads (malformed, unsigned,"
                         " badly signed, too large, expiring too far ahead, ...)",
                      f"the coordinator went on looking ({looks} looks since the attack) with no traceback and one"
                      f" warning per key and reason ({len(warned)}); a joiner read the coordinator's configuration")


def test_the_monitor_stores_the_largest_records_the_schema_allows(tmp_path, cleanup, takeover_rows):
    """Two volunteers' records at the schema's bounds (every integer 2**63 - 1, every rate the largest finite float):
    each fits the metrics store, their sums did not, and the coordinator's monitor raised OverflowError at every look
    (and at every restart while the records lived). Its sums saturate, and it stores what it saw."""
    run_id = "hostile-bounds"
    honest = HonestPeer(run_id)
    cleanup.append(honest.dht)
    keys = [RSAPrivateKey(), RSAPrivateKey()]
    attacker = hivemind.DHT(initial_peers=honest.addresses, host_maddrs=LOOPBACK, start=True,
                            record_validators=[HostileSigner({owner_subkey(key): key for key in keys})])
    cleanup.append(attacker)
    most, fastest, now = INT64_MAX, sys.float_info.max, get_dht_time()
    for index, key in enumerate(keys):
        peer = PeerRecord(peer_id=f"QmLargest{index}", name="largest", hardware="?", client_mode=False, epoch=most,
                          samples_per_second=fastest, loss=fastest, samples=most, time=time.time(), inner_steps=most,
                          pseudo_gradient_norm=fastest, round_bytes=most, train_seconds=fastest, swarm_seconds=fastest,
                          rounds_averaged=most, rounds_alone=most, rounds_failed=most)
        progress = LocalTrainingProgress(peer_id=fake_peer_id(), epoch=most, samples_accumulated=most,
                                         samples_per_second=fastest, time=now, client_mode=False)
        attack(attacker, [(metrics_key(run_id), owner_subkey(key), peer.dict(), now + 60),
                          (progress_key(run_id), owner_subkey(key), progress.dict(), now + 60)])

    with MetricsWriter(tmp_path / "metrics.db") as writer:
        snapshot = SwarmMonitor(honest.dht, honest.config, writer).refresh()
    assert (snapshot.epoch, snapshot.samples_accumulated, snapshot.samples_per_second) == (most, most, fastest)
    assert snapshot.alive_peers == 3 and snapshot.mean_loss is not None and math.isfinite(snapshot.mean_loss)
    with MetricsReader(tmp_path / "metrics.db") as reader:
        assert reader.snapshots()[-1].samples_accumulated == most
        assert sorted(row.name for row in reader.peers()) == ["honest", "largest", "largest"]
    takeover_rows.add(4, "two volunteers' records at the schema's bounds: every integer 2^63 - 1, every rate the"
                         " largest float (their sums raised OverflowError at every look)",
                      f"the monitor stored its look: epoch {snapshot.epoch}, samples {snapshot.samples_accumulated}"
                      f" (saturated), {snapshot.alive_peers} peers")


def test_one_key_keeps_one_entry_per_key(caplog, cleanup, takeover_rows):
    """hivemind signs any subkey that holds its owner's key: one volunteer kept three progress and three metrics
    entries under one key by varying what followed it, three peers to count (rounds due later, --min-peers met by
    ghosts) and three rows in the store. A guarded node refuses them, and a reader skips them once with a warning."""
    run_id = "hostile-one-key"
    honest = HonestPeer(run_id)
    cleanup.append(honest.dht)
    attacker = start_attacker(honest.addresses, victim=b"")
    cleanup.append(attacker)
    reader = start_dht(honest.dht, attacker, validators=[RSASignatureValidator()])  # checks signatures, no guard
    cleanup.append(reader)
    now = get_dht_time()
    stores = [(key, owner_subkey(ATTACKER_KEY) + suffix, well_formed(kind, run_id, ""), now + 30)
              for key, kind in ((metrics_key(run_id), "metrics"), (progress_key(run_id), "progress"))
              for suffix in (b"1", b"2", b"3")]
    attack(attacker, stores)
    # the guarded node refused them: what it holds under each key is the honest peer's entry alone
    assert read_swarm_progress(honest.dht, run_id).peers == 1
    assert [r.name for r in read_peer_records(honest.dht, run_id)] == ["honest"]
    # the attacker's own node holds them: a reader that finds them there skips them, with one warning per key
    caplog.set_level(logging.WARNING, logger=GUARD_LOGGER)
    found = reader.get(progress_key(run_id), latest=True, return_future=True).result(timeout=30)
    assert found is not None and sum(owner_subkey(ATTACKER_KEY) in subkey for subkey in found.value) == 3
    usable = usable_entries(progress_key(run_id), found.value, LocalTrainingProgress)
    assert not any(owner_subkey(ATTACKER_KEY) in subkey for subkey, _, _ in usable)
    assert len([m for m in skip_warnings(caplog, progress_key(run_id)) if "one entry per key" in m]) == 1
    takeover_rows.add(6, "one key stores three progress and three metrics entries, varying what follows it in the"
                         " subkey",
                      f"a guarded node counted {read_swarm_progress(honest.dht, run_id).peers} peer (the honest one);"
                      " a reader that found them elsewhere skipped them with one warning")
