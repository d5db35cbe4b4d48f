"""One volunteer cannot take a public run over (issue 27): each test mounts one attack with a plain hivemind process
that signs its records with its own key, and shows what the honest roles do."""

import dataclasses
import functools
import json
import re
import textwrap
import time
import types

import hivemind
import pytest
import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.optim.progress_tracker import LocalTrainingProgress
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from conftest import TakeoverRows, publisher_identity, start_coordinator
from hivetrain.roles.coordinator.swarm_monitor import SwarmMonitor
from hivetrain.clock import (EPOCHS_AHEAD, ClockRecord, ClockWatcher, RecordWatcher, clock_key, publish_clock,
                             read_clock, swarm_epoch)
from hivetrain.config import RunConfig, get_preset
from hivetrain.coordinator_watch import CoordinatorWatch
from hivetrain.hivemind_internals import BoundedStateAverager, write_identity
from hivetrain.metrics_store import MetricsReader, MetricsWriter
from hivetrain.model import create_model, parameter_count
from hivetrain.outer_state import OuterState
from hivetrain.record_guard import VettedProgressTracker
from hivetrain.run_record import RUN_KEY, RunManifest, fetch_run, guard_run_keys, publish_run_config, signer_peer_id
from hivetrain.swarm import DHTOptions, SwarmError, start_dht
from hivetrain.swarm_optimizer import SwarmOptimizer
from hivetrain.telemetry import PeerRecord, metrics_key, progress_key, publish_peer_record

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
DECADE = 10 * 365 * 86400.0


def _addresses(dht: hivemind.DHT) -> list[str]:
    return [str(a) for a in dht.get_visible_maddrs()]


def _start_signer(initial_peers: list[str], cleanup: list) -> tuple[hivemind.DHT, RSASignatureValidator]:
    """A plain hivemind process that signs what it stores with a key of its own, as any volunteer can."""
    signer = RSASignatureValidator(RSAPrivateKey())
    dht = hivemind.DHT(initial_peers=initial_peers, host_maddrs=LOOPBACK, record_validators=[signer], start=True)
    cleanup.append(dht)
    return dht, signer


def _start_hijacker(tmp_path, initial_peers: list[str], config) -> hivemind.DHT:
    """A volunteer whose identity key also signs its records (so its records are pinned to its own peer ID, as a
    coordinator's are) and that publishes its own run record: another model and run, robust aggregation off, and a
    `time` ten years ahead, the shape that used to win every joiner."""
    key = RSAPrivateKey()
    write_identity(key, str(tmp_path / "hijacker.key"))
    signer = RSASignatureValidator(key)
    dht = hivemind.DHT(initial_peers=initial_peers, host_maddrs=LOOPBACK, record_validators=[signer],
                       identity_path=str(tmp_path / "hijacker.key"), start=True)
    record = RunManifest(run_id=config.run_id, config=config.to_json(), fingerprint=config.fingerprint,
                       time=time.time() + DECADE)
    assert dht.store(RUN_KEY, record.dict(), get_dht_time() + 60, subkey=signer.local_public_key)
    return dht


def test_a_joiner_believes_only_the_run_record_of_the_peer_it_was_told_to_join(tmp_path, cleanup, caplog,
                                                                               takeover_rows):
    honest = get_preset("demo").replace(run_id="takeover-honest")
    demo = get_preset("demo")
    hijacked = demo.replace(run_id="takeover-hijacked", batch_size=demo.batch_size * 2,
                            swarm=dataclasses.replace(demo.swarm, robust_aggregation="none"))
    coordinator = start_dht(DHTOptions(host_maddrs=LOOPBACK, identity_path=publisher_identity()))
    cleanup.append(coordinator)
    assert publish_run_config(coordinator, honest)
    hijacker = _start_hijacker(tmp_path, _addresses(coordinator), hijacked)
    cleanup.append(hijacker)
    # The hijacker also claims the coordinator's own run id: same key, newer time, another model.
    same_id = hijacked.replace(run_id=honest.run_id)
    forger, signer = _start_signer(_addresses(coordinator), cleanup)
    assert forger.store(RUN_KEY, RunManifest(run_id=same_id.run_id, config=same_id.to_json(),
                                           fingerprint=same_id.fingerprint, time=time.time() + DECADE).dict(),
                        get_dht_time() + 60, subkey=signer.local_public_key)
    joiner = start_dht(DHTOptions(host_maddrs=LOOPBACK, initial_peers=_addresses(coordinator)))
    cleanup.append(joiner)

    # Told the coordinator's address: the coordinator's run, whatever else the swarm holds.
    trusted = fetch_run(joiner, None, _addresses(coordinator), timeout=30)
    assert trusted.config == honest and trusted.coordinator == coordinator.peer_id.to_base58()
    assert signer_peer_id(trusted.signer) == coordinator.peer_id.to_base58()
    # Told a volunteer's address (the hijacker's): its own record is pinned to it, so the user trusted it by naming it;
    # --coordinator puts the trust back where it belongs.
    assert fetch_run(joiner, None, _addresses(hijacker), timeout=30).config == hijacked
    run = fetch_run(joiner, None, _addresses(hijacker), coordinator=coordinator.peer_id.to_base58(), timeout=30)
    assert run.config == honest
    # Told the forger's address: nothing it signed hashes to its peer ID, and the joiner refuses in one line.
    with pytest.raises(SwarmError, match=r"signed by none of the peers you named .*--coordinator PEER_ID"):
        fetch_run(joiner, honest.run_id, _addresses(forger), timeout=2)
    # Taking any record is a choice, with a warning: then the newest, whoever signed it, wins.
    with caplog.at_level("WARNING", logger="hivetrain.run_record"):
        run = fetch_run(joiner, honest.run_id, _addresses(forger), timeout=10, any_coordinator=True)
    assert run.config == same_id and run.coordinator is None
    assert [r.getMessage() for r in caplog.records if r.name == "hivetrain.run_record"] == [
        f"Run {honest.run_id} comes from a record nobody vouches for (--any-coordinator): its signer"
        f" ({signer_peer_id(signer.local_public_key)}) is not a peer you named"]
    takeover_rows.add(1, "two volunteers publish run records dated ten years ahead, of another run id and batch"
                         " size, one under the coordinator's run id",
                      f"a joiner given the coordinator's address took its run ({trusted.config.run_id}, batch"
                      f" {trusted.config.batch_size}; the records' batch: {hijacked.batch_size}); given the forger's"
                      " address, it refused in one line")


@pytest.mark.parametrize("model, message", [
    (dict(name="hf-hub:someone/model"), "is not a timm model name"),
    (dict(kwargs=dict(pretrained_cfg_overlay=dict(file="/etc/passwd"))), "'pretrained_cfg_overlay' is not one"),
    (dict(kwargs=dict(checkpoint_path="https://example.com/weights.pth")), "'checkpoint_path' is not one"),
    (dict(kwargs=dict(depth=10**6)), r"depth=1000000 is outside 0\.\.256"),
    (dict(img_size=10**6), "img_size must be"),
])
def test_a_run_record_cannot_point_volunteers_at_files_or_huge_models(model, message, takeover_rows):
    """Finding 8: the model settings a run record carries are architecture settings within bounds, read before any
    model is built; a record that breaks them does not load (and readers skip it with one warning)."""
    raw = get_preset("demo").to_dict()
    raw["model"] = {**raw["model"], **model}
    with pytest.raises(ValueError, match=message) as refused:
        RunConfig.from_dict(raw)
    takeover_rows.add(8, f"a run record whose model carries `{json.dumps(model)}`",
                      f"refused before any model is built: \"{textwrap.shorten(str(refused.value), 100)}\"")


def test_a_model_beyond_a_volunteers_means_is_refused_before_it_is_built():
    demo = get_preset("demo")
    huge = dataclasses.replace(demo.model, kwargs=dict(demo.model.kwargs, embed_dim=16384, depth=256))
    assert parameter_count(demo.model) == sum(p.numel() for p in create_model(demo.model).parameters())
    with pytest.raises(ValueError, match=r"has 824,701,108,234 parameters, over the 2,000,000,000"):
        create_model(huge)


def test_a_volunteer_cannot_overwrite_another_volunteers_row(tmp_path, cleanup, caplog, takeover_rows):
    """Finding 6: a metrics record's peer_id is its writer's word. The monitor keeps one row per peer ID, written only
    by the key that first claimed it; an impostor's record under its own key is skipped, with one warning."""
    config = get_preset("demo").replace(run_id="takeover-rows")
    coordinator = hivemind.DHT(host_maddrs=LOOPBACK, start=True)
    cleanup.append(coordinator)
    honest = start_dht(DHTOptions(host_maddrs=LOOPBACK, initial_peers=_addresses(coordinator)))
    cleanup.append(honest)
    impostor, signer = _start_signer(_addresses(coordinator), cleanup)
    victim_id = honest.peer_id.to_base58()
    record = PeerRecord(peer_id=victim_id, name="alice", hardware="test CPU", client_mode=False, epoch=3,
                        samples_per_second=10.0, loss=0.5, samples=640, time=time.time())
    publish_peer_record(honest, config.run_id, record, wait=True)
    with MetricsWriter(tmp_path / "metrics.sqlite") as writer:
        monitor = SwarmMonitor(coordinator, config, writer)
        assert monitor.refresh().alive_peers == 1
        forged = record.copy(update=dict(name="mallory", samples=10**12, loss=0.0))
        assert impostor.store(metrics_key(config.run_id), forged.dict(), get_dht_time() + 60,
                              subkey=signer.local_public_key)
        with caplog.at_level("WARNING", logger="hivetrain.record_guard"):
            for _ in range(3):
                snapshot = monitor.refresh()
        assert snapshot.alive_peers == 1
    with MetricsReader(tmp_path / "metrics.sqlite") as reader:
        rows = [(p.peer_id, p.name, p.samples) for p in reader.peers()]
    assert rows == [(victim_id, "alice", 640)]
    warned = [r.getMessage() for r in caplog.records if "claims another peer's ID" in r.getMessage()]
    assert warned == [f"Skipping a record under {metrics_key(config.run_id)}: claims another peer's ID: {victim_id}"]
    takeover_rows.add(6, "a volunteer publishes another's peer ID under its own key: name \"mallory\", 10^12 samples",
                      f"the store kept {len(rows)} row, the victim's ({rows[0][1]}, {rows[0][2]} samples), after"
                      f" three looks; {len(warned)} warning")


@pytest.mark.parametrize("previous, claims, counted", [
    (0, [], 0),
    (5, [6, 6, 7], 6),  # the honest swarm moves on: the count is the epoch most of it has reached
    (5, [7, 7, 7], 7),
    (5, [6, 10**12], 6),  # one claim among two, far ahead: skipped
    (5, [6, 37], 6),  # a peer ahead of the others (it trained alone while cut off) moves nothing
    (5, [37], 37),  # a lone claim moves the count at most EPOCHS_AHEAD per look
    (5, [38], 5),
    (5, [6, 6, 10**12], 6),  # the same among three: the majority holds
    (0, [500, 500, 10**12], 500),  # a restarted coordinator learns the swarm's epoch from the majority
    (0, [500], 0),  # a lone claim far ahead, honest or not, counts for nothing
    (0, [10**12], 0),
    (0, [500, 10**12], 500),
    (9, [3, 4], 9),  # never back
    (9, [3], 9),
])
def test_the_coordinator_counts_the_swarms_epoch_itself(previous, claims, counted):
    assert EPOCHS_AHEAD == 32
    assert swarm_epoch(previous, claims) == counted


def test_an_inflated_epoch_moves_neither_the_coordinator_nor_the_peers(tmp_path, cleanup, caplog):
    """Finding 2: a volunteer's progress record, validly signed by its own key, claims epoch 10^12 (it once set the
    coordinator's epoch for good and made every sync peer reload the state at each step). The coordinator's count
    stays the honest swarm's, its signed clock says so, and a peer's tracker bounded by that clock counts the honest
    peer only; a groupmate's round and a downloaded state beyond the clock are skipped alike."""
    run_id = "takeover-epoch"
    coordinator = start_dht(DHTOptions(host_maddrs=LOOPBACK, identity_path=publisher_identity()))
    cleanup.append(coordinator)
    peer = start_dht(DHTOptions(host_maddrs=LOOPBACK, initial_peers=_addresses(coordinator)))
    cleanup.append(peer)
    attacker, signer = _start_signer(_addresses(coordinator), cleanup)
    for dht in (coordinator, peer):  # as the roles do once they know the run: guarded, signing what they store
        dht.add_validators([RSASignatureValidator()])
        guard_run_keys(dht, run_id)
    for dht, key, epoch in ((peer, RSASignatureValidator().local_public_key, 3),
                            (attacker, signer.local_public_key, 10**12)):
        progress = LocalTrainingProgress(peer_id=dht.peer_id.to_bytes(), epoch=epoch, samples_accumulated=8,
                                         samples_per_second=1.0, time=get_dht_time(), client_mode=False)
        assert dht.store(progress_key(run_id), progress.dict(), get_dht_time() + 300, subkey=key)

    config = get_preset("demo").replace(run_id=run_id)
    with MetricsWriter(tmp_path / "metrics.sqlite") as writer, caplog.at_level("WARNING"):
        monitor = SwarmMonitor(coordinator, config, writer, start_epoch=3)
        for _ in range(3):
            snapshot = monitor.refresh()
        assert (snapshot.epoch, snapshot.alive_peers) == (3, 0)  # no metrics records: progress only
    assert [r.getMessage() for r in caplog.records if "ahead of the swarm" in r.getMessage()] == [
        f"Skipping a record under {progress_key(run_id)}: ahead of the swarm: epoch {10**12}, the swarm is at 3"]

    assert publish_clock(coordinator, run_id, snapshot.epoch)
    watcher = ClockWatcher(peer, run_id, RSASignatureValidator().local_public_key, every=0.2).start()
    try:
        deadline = time.monotonic() + 30
        while watcher.bound() is None:
            assert time.monotonic() < deadline, "the clock never arrived"
            time.sleep(0.2)
        assert watcher.bound() == 3 + EPOCHS_AHEAD
        unbounded = VettedProgressTracker(peer, run_id, target_batch_size=64, start=False)
        assert unbounded.global_progress.epoch == 10**12  # what every peer used to follow
        tracker_class = type("Bounded", (VettedProgressTracker,), dict(epoch_bound=staticmethod(watcher.bound)))
        bounded = tracker_class(peer, run_id, target_batch_size=64, start=False)
        assert (bounded.global_progress.epoch, bounded.global_progress.num_peers) == (3, 1)
        outer = types.SimpleNamespace(epoch_bound=watcher.bound, prefix=f"{run_id}_outer")
        assert OuterState._usable_rounds(outer, [3, 4, 10**12, -1, None]) == [3, 4]
    finally:
        watcher.stop()
    # A forged clock, under the attacker's key, is not the coordinator's.
    forged = ClockRecord(run_id=run_id, epoch=10**12, time=get_dht_time())
    assert attacker.store(clock_key(run_id), forged.dict(), get_dht_time() + 60, subkey=signer.local_public_key)
    assert read_clock(peer, run_id, RSASignatureValidator().local_public_key).epoch == 3


def test_a_sync_peer_trains_on_beside_a_progress_record_at_epoch_a_trillion(spawn, tmp_path, cleanup, takeover_rows):
    """Finding 2, as mounted: a plain hivemind process stores a validly signed progress record at epoch 10^12 before
    a volunteer joins. The coordinator's count stays the swarm's, and the volunteer trains its three swarm epochs
    one after another, loading the state once, as it joins."""
    coordinator, addresses = start_coordinator(spawn, tmp_path, "--preset", "demo", "--mode", "sync",
                                               "--validate-every", "0", "--refresh", "1")
    run_id = get_preset("demo").run_id
    attacker, signer = _start_signer(addresses, cleanup)
    progress = LocalTrainingProgress(peer_id=attacker.peer_id.to_bytes(), epoch=10**12, samples_accumulated=8,
                                     samples_per_second=1.0, time=get_dht_time(), client_mode=False)
    assert attacker.store(progress_key(run_id), progress.dict(), get_dht_time() + 500, subkey=signer.local_public_key)
    events = tmp_path / "peer.events"
    peer = spawn("peer", "peers/join.py", "--host", "127.0.0.1", "--initial-peers", *addresses, "--threads", "1",
                 "--stop-at-epoch", "3", "--events", str(events))
    assert peer.wait(timeout=240) == 0, peer.lines[-20:]
    written = [json.loads(line) for line in events.read_text().splitlines()]
    assert [e["epoch"] for e in written if e["event"] == "epoch"] == [1, 2, 3]
    assert sum(e["event"] == "state_loaded" for e in written) == 1
    counted = [int(m.group(1)) for line in coordinator.lines if (m := re.match(r"^swarm epoch (\d+) \|", line))]
    assert counted and max(counted) <= 3, counted[-5:]
    trained = [e["epoch"] for e in written if e["event"] == "epoch"]
    takeover_rows.add(2, "a validly signed progress record at epoch 10^12, stored before a volunteer joins",
                      f"the volunteer trained swarm epochs {', '.join(map(str, trained))} and loaded the state"
                      f" {sum(e['event'] == 'state_loaded' for e in written)} time; the coordinator counted at most"
                      f" epoch {max(counted)}")


def test_a_download_skips_holders_beyond_the_clock_or_oversized_and_takes_no_settings(cleanup, takeover_rows):
    """Findings 2 and 3: hivemind took the state of the holder declaring the highest priority, whole: its epoch (the
    LR schedule stepped up to it, once per epoch: 10^12 steps hung the peer), any size, and its param groups (an lr of
    10^6). A BoundedStateAverager asks the holders in order and skips, before deserialising anything, one declaring a
    priority beyond its bound, one serving a state beyond it, one sending more than its own tensors allow, and one
    whose tensors have other shapes (hivemind's load then failed at every try); from the honest holder it takes
    parameters, statistics and epoch, never the settings."""
    bootstrap = hivemind.DHT(host_maddrs=LOOPBACK, start=True)
    cleanup.append(bootstrap)

    def averager(cls, width: int, lr: float, weight_decay: float, **kwargs):
        dht = hivemind.DHT(host_maddrs=LOOPBACK, initial_peers=_addresses(bootstrap), start=True)
        cleanup.append(dht)
        model = torch.nn.Linear(width, 2)
        made = cls(dht=dht, prefix="takeover-state_state_averager", params=model.parameters(), start=True,
                   optimizer=functools.partial(torch.optim.SGD, lr=lr, momentum=0.9, weight_decay=weight_decay),
                   scheduler=functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=lambda step: 0.5),
                   **kwargs)
        cleanup.append(made)  # shut down before its DHT (cleanup runs in reverse)
        return made

    def holder(width: int, epoch: int, priority: float) -> TrainingStateAverager:
        made = averager(TrainingStateAverager, width, lr=1e6, weight_decay=100.0, allow_state_sharing=True)
        made.local_epoch, made.state_sharing_priority = epoch, priority
        return made

    honest = holder(4, epoch=7, priority=1)
    holder(4, epoch=10**12, priority=9)  # within the bound by its word, beyond it by its state
    holder(40_000, epoch=7, priority=8)  # 80,002 parameters and their momentum where the peer has 10
    holder(3, epoch=7, priority=7)  # a state of another shape
    holder(4, epoch=7, priority=10**6)  # declares itself beyond the bound
    peer = averager(BoundedStateAverager, 4, lr=0.1, weight_decay=0.0, allow_state_sharing=False)
    peer.epoch_bound = lambda: 10
    deadline = time.monotonic() + 30
    while len((peer.dht.get("takeover-state_state_averager.all_averagers", latest=True) or ({}, None))[0]) < 5:
        assert time.monotonic() < deadline, "the holders never declared their states"
        time.sleep(0.2)
    peer.load_state_from_peers(timeout=10)
    assert peer.local_epoch == 7
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(peer.main_parameters, honest.main_parameters))
    assert [group["lr"] for group in peer.optimizer.param_groups] == [0.05]  # its own lr, as its schedule puts it
    assert peer.optimizer.param_groups[0]["weight_decay"] == 0.0  # not the holder's 100
    takeover_rows.add(3, "four holders outbid an honest one: priority 10^6, a state of epoch 10^12, 80,002 parameters"
                         " where the model has 10, another shape; each serves lr 10^6 and weight decay 100",
                      f"a joiner skipped the four and took the honest holder's epoch ({peer.local_epoch}) and"
                      f" parameters, with its own lr ({peer.optimizer.param_groups[0]['lr']:g}) and weight decay"
                      f" ({peer.optimizer.param_groups[0]['weight_decay']:g})")


def test_a_download_limited_to_one_holder_asks_no_other(cleanup):
    """A rollback's state is taken from the coordinator alone (CoordinatorWatch.holder): in CI an attacker had trained
    up to the very epoch the rollback served, and hivemind's order among equal holders handed the honest peer the
    attacker's state. Two holders of one epoch: the one declaring the higher priority serves an unlimited download,
    and nothing when the download names the other. Unlimited, it takes the state of that holder once it is the one
    trusted (the pinned coordinator's, BoundedDownloads.trusted_holder), although the other is asked first."""
    bootstrap = hivemind.DHT(host_maddrs=LOOPBACK, start=True)
    cleanup.append(bootstrap)

    def averager(fill: float, **kwargs) -> BoundedStateAverager:
        dht = hivemind.DHT(host_maddrs=LOOPBACK, initial_peers=_addresses(bootstrap), start=True)
        cleanup.append(dht)
        model = torch.nn.Linear(4, 2)
        torch.nn.init.constant_(model.weight, fill)
        made = BoundedStateAverager(dht=dht, prefix="one-holder_state_averager", params=model.parameters(),
                                    optimizer=functools.partial(torch.optim.SGD, lr=0.1), start=True, **kwargs)
        cleanup.append(made)
        return made

    pinned = averager(1.0, allow_state_sharing=True)
    other = averager(-1.0, allow_state_sharing=True)
    pinned.local_epoch = other.local_epoch = 15
    pinned.state_sharing_priority, other.state_sharing_priority = 1, 2
    peer = averager(0.0, allow_state_sharing=False)
    deadline = time.monotonic() + 30
    while len((peer.dht.get("one-holder_state_averager.all_averagers", latest=True) or ({}, None))[0]) < 2:
        assert time.monotonic() < deadline, "the holders never declared their states"
        time.sleep(0.2)
    with peer.downloading_only_from(pinned.peer_id.to_base58()):
        peer.load_state_from_peers(timeout=10)
    assert peer.local_epoch == 15 and torch.equal(peer.main_parameters[0], pinned.main_parameters[0])
    assert peer.only_holder is None  # the block's end lifts the limit: the next download asks any holder
    peer.local_epoch, peer.trusted_holder = 0, other.peer_id.to_base58()
    peer.load_state_from_peers(timeout=10)
    assert torch.equal(peer.main_parameters[0], other.main_parameters[0])


def test_a_sync_peer_beyond_the_clock_keeps_its_epoch_until_a_holder_serves_the_swarms_state(cleanup):
    """A sync peer beyond the clock steps back to the count before it downloads (hivemind takes no state behind a
    peer's epoch). The faults suite once saw that download fail on a link barely back: the peer stood at the count
    with the parameters it had trained alone, passed for in step, and trained beside the swarm for 50 epochs. With no
    holder to serve, it now stands at its own epoch again (and tries again later); once one serves, it takes the
    state."""
    bootstrap = hivemind.DHT(host_maddrs=LOOPBACK, start=True)
    cleanup.append(bootstrap)
    run_id = "step-back"

    def dht() -> hivemind.DHT:
        cleanup.append(hivemind.DHT(host_maddrs=LOOPBACK, initial_peers=_addresses(bootstrap), start=True))
        return cleanup[-1]

    peer = SwarmOptimizer(dht=dht(), run_id=run_id, params=torch.nn.Linear(4, 2).parameters(), target_batch_size=64,
                          batch_size_per_step=8, optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                          load_state_timeout=5)
    cleanup.append(peer)  # shut down before its DHT (cleanup runs in reverse)
    peer.state_averager.local_epoch = 50
    alone = [param.detach().clone() for param in peer.state_averager.main_parameters]
    assert peer.step_back_to(10) is False
    assert peer.local_epoch == 50
    assert all(torch.equal(mine, kept) for mine, kept in zip(peer.state_averager.main_parameters, alone))

    holder = TrainingStateAverager(dht=dht(), prefix=f"{run_id}_state_averager", start=True,
                                   params=torch.nn.Linear(4, 2).parameters(), allow_state_sharing=True,
                                   optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    cleanup.append(holder)
    holder.local_epoch, holder.state_sharing_priority = 12, 12
    deadline = time.monotonic() + 30
    while holder.peer_id not in (peer.dht.get(f"{run_id}_state_averager.all_averagers", latest=True) or ({}, None))[0]:
        assert time.monotonic() < deadline, "the holder never declared its state"
        time.sleep(0.2)
    assert peer.step_back_to(10) is True
    assert peer.local_epoch >= 12  # the holder's epoch (hivemind moves a peer one epoch behind the swarm's on)
    assert all(torch.equal(mine, theirs)
               for mine, theirs in zip(peer.state_averager.main_parameters, holder.main_parameters))


def test_a_peer_far_beyond_a_fresh_clock_takes_the_swarms_state_and_one_still_cut_off_does_not(monkeypatch):
    """A peer cut off from the swarm trains on alone, its epochs coming fast; back online, far beyond the clock, it is
    the one to take the swarm's state (the others skip its records). While cut off, it reads only the clock it had:
    as that stops changing, it does nothing; nor does it when the count goes back (a restarted coordinator)."""
    monkeypatch.setattr("hivetrain.coordinator_watch.REJOIN_EVERY", 0.0)
    monkeypatch.setattr("hivetrain.clock.CLOCK_FRESH", 1.0)
    published = [ClockRecord(run_id="run", epoch=10, time=1.0)]

    class Clock(ClockWatcher):
        def __init__(self):
            RecordWatcher.__init__(self, lambda: published[-1], "test-clock", every=0.05)

    watch = CoordinatorWatch.__new__(CoordinatorWatch)
    watch.clock, watch._next_rejoin = Clock().start(), 0.0
    try:
        deadline = time.monotonic() + 10
        while watch.clock.latest is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert watch.ran_ahead(10 + EPOCHS_AHEAD) is None  # ahead, as the swarm may be between two looks
        assert watch.ran_ahead(11 + EPOCHS_AHEAD) == 10  # further: take the state the swarm has at 10 or so
        time.sleep(1.2)  # the coordinator is out of reach: the same clock, read again and again
        assert watch.clock.fresh_count() is None and watch.ran_ahead(10**6) is None
        published.append(ClockRecord(run_id="run", epoch=12, time=2.0))  # back online: the next look's clock
        time.sleep(0.3)
        assert watch.ran_ahead(10**6) == 12
        # The coordinator restarted without its count: it says 0 until it has counted the swarm again. A peer at epoch
        # 50 is ahead of no one, and the bound stays where the count had got.
        published.append(ClockRecord(run_id="run", epoch=0, time=3.0))
        time.sleep(0.3)
        assert watch.clock.bound() == 12 + EPOCHS_AHEAD and watch.ran_ahead(50) is None
    finally:
        watch.clock.stop()


def test_takeover_rows_rewrite_their_own_section_of_the_reliability_page(tmp_path):
    page = tmp_path / "reliability.md"
    page.write_text("# Reliability: faults a swarm survives\n\nfaults\n\n## attacks\n\nA\n")
    rows = TakeoverRows(page)
    rows.add(3, "a poisoned holder", "skipped")
    rows.add(1, "a hijacking record", "ignored")
    rows.add(3, "a poisoned holder", "skipped again")  # a test run twice keeps one row
    text = page.read_text()
    assert text.startswith("# Reliability: faults a swarm survives\n\nfaults\n\n## attacks\n\nA\n\n## takeover\n")
    assert "`pytest tests/test_takeover.py tests/test_vouched_state.py tests/test_hostile_records.py" in text
    rows_written = [line for line in text.splitlines() if line.startswith("| 1.") or line.startswith("| 3.")]
    assert rows_written == ["| 1. run-record hijack | a hijacking record | ignored |",
                            "| 3. poisoned state | a poisoned holder | skipped again |"]
