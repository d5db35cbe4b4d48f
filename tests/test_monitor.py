"""The monitor's parts in one process: peers' records through a real DHT, malformed records skipped, and a validator
that outlives failed state downloads."""

import logging
import threading
import time

import hivemind
import torch
from hivemind.utils import get_dht_time

from hivetrain.roles.coordinator.swarm_monitor import SwarmMonitor
from hivetrain.roles.coordinator.validator import Validator
from hivetrain.checkpoint import LocalCheckpointStore
from hivetrain.checkpoint_location import load_checkpoint
from hivetrain.config import get_preset
from hivetrain.data import make_datamodule
from hivetrain.evaluate import evaluate
from hivetrain.metrics_store import MetricsReader, MetricsWriter
from hivetrain.model import create_model
from hivetrain.telemetry import PeerRecord, metrics_key, publish_peer_record, read_peer_records

CONFIG = get_preset("demo").replace(run_id="monitor-test")


def _record(name: str, samples: int, **changes) -> dict:
    fields = dict(peer_id=f"Qm{name}", name=name, hardware="test CPU", client_mode=False, epoch=3,
                  samples_per_second=10.0, loss=0.5, samples=samples, time=time.time())
    return PeerRecord(**{**fields, **changes})


def _dht(*initial: hivemind.DHT) -> hivemind.DHT:
    peers = [str(a) for dht in initial for a in dht.get_visible_maddrs()]
    return hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=peers, start=True)


def test_records_reach_the_monitor_and_malformed_ones_are_skipped(tmp_path):
    # A node that does not follow the schema (a plain DHT without our validators) holds garbage in the run's metrics
    # key before the others join.
    rogue = _dht()
    started = [rogue]
    try:
        garbage = {"name": 5, "samples": "many"}
        assert rogue.store(metrics_key(CONFIG.run_id), subkey=b"rogue", value=garbage,
                           expiration_time=get_dht_time() + 60)
        assert rogue.get(metrics_key(CONFIG.run_id), latest=True).value[b"rogue"].value == garbage
        peer = _dht(rogue)
        coordinator = _dht(rogue, peer)
        started += [peer, coordinator]
        publish_peer_record(peer, CONFIG.run_id, _record("alice", 640), wait=True)
        # The reader skips what the rogue holds.
        records = read_peer_records(coordinator, CONFIG.run_id)
        assert [(r.name, r.samples) for r in records] == [("alice", 640)]

        with MetricsWriter(tmp_path / "metrics.sqlite") as writer:
            snapshot = SwarmMonitor(coordinator, CONFIG, writer).refresh()
        assert (snapshot.alive_peers, snapshot.epoch, snapshot.mean_loss) == (1, 3, 0.5)
        with MetricsReader(tmp_path / "metrics.sqlite") as reader:
            assert [(p.name, p.samples, p.hardware) for p in reader.peers()] == [("alice", 640, "test CPU")]
            assert len(reader.snapshots()) == 1
    finally:
        for dht in reversed(started):
            dht.shutdown()


def test_a_peer_that_says_goodbye_or_lapses_is_counted_out_and_marked_left(tmp_path):
    peer = _dht()
    coordinator = _dht(peer)
    try:
        with MetricsWriter(tmp_path / "metrics.sqlite") as writer, MetricsReader(tmp_path / "metrics.sqlite") as reader:
            monitor = SwarmMonitor(coordinator, CONFIG, writer)

            def look() -> tuple[int, list]:
                snapshot = monitor.refresh()
                return snapshot.alive_peers, [(p.name, p.samples, p.left_at is not None) for p in reader.peers()]

            # killed: no goodbye, its record lapses (a short lifetime here; the DHT keeps the record expiring last)
            publish_peer_record(peer, CONFIG.run_id, _record("alice", 576), ttl=2.0, wait=True)
            assert look() == (1, [("alice", 576, False)])
            time.sleep(2.5)
            assert look() == (0, [("alice", 576, True)])
            # the same peer back (a restart with its identity): in again
            publish_peer_record(peer, CONFIG.run_id, _record("alice", 640), wait=True)
            assert look() == (1, [("alice", 640, False)])
            assert monitor.last_peers_epoch is None  # a peer trains
            # a clean leave: the last record carries the last samples and says so; counted out at the next look,
            # and the epoch it reached on its way out (its progress record already gone) is the swarm's
            publish_peer_record(peer, CONFIG.run_id, _record("alice", 704, epoch=7, left=True), wait=True)
            assert look() == (0, [("alice", 704, True)])
            assert monitor.latest.epoch == 7
            assert monitor.last_peers_epoch == 7  # what the last peer keeps up for the coordinator (hand_over)
    finally:
        coordinator.shutdown()
        peer.shutdown()


class FlakyHolder:
    """A StateHolder whose downloads fail `failures` times (like a peer dropping the stream), then succeed."""

    def __init__(self, failures: int):
        self.failures, self.epoch, self.has_state = failures, 0, False
        self.model = create_model(CONFIG.model, seed=CONFIG.seed)

    def load_from_peers(self) -> bool:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("peer dropped the stream")
        with torch.no_grad():
            for param in self.model.parameters():
                param.add_(0.01)
        self.epoch, self.has_state = self.epoch + 2, True
        return True

    def checkpoint(self, metrics):
        from hivetrain.checkpoint import Checkpoint

        return Checkpoint.from_model(self.model, CONFIG, self.epoch, metrics)


def test_validator_survives_failed_downloads_and_keeps_the_best(tmp_path, caplog):
    loader = make_datamodule(CONFIG, val_limit=64).val_dataloader()
    holder = FlakyHolder(failures=4)  # 3 attempts fail at epoch 2, the first attempt at epoch 4 fails too
    swarm_epoch = [2]
    store = LocalCheckpointStore(tmp_path / "checkpoints")
    with MetricsWriter(tmp_path / "metrics.sqlite") as writer:
        validator = Validator(holder, loader, writer, store, swarm_epoch=lambda: swarm_epoch[0], backoff=0.01,
                              report=lambda line: None)
        with caplog.at_level(logging.WARNING):
            assert validator.tick() is None
            assert validator.tick() is None  # no retry storm: the same epoch waits for a newer one
        assert "Could not load the swarm's state at epoch 2 after 3 attempts" in caplog.text
        assert holder.failures == 1
        swarm_epoch[0] = 4
        row = validator.tick()
        assert row is not None and row.epoch == 2 and holder.failures == 0
        # The run loop keeps going after anything a tick raises.
        stop = threading.Event()
        holder.load_from_peers = lambda: (_ for _ in ()).throw(ValueError("garbage state"))
        swarm_epoch[0] = 6
        thread = threading.Thread(target=validator.run, args=(stop, 0.01))
        thread.start()
        time.sleep(0.3)
        assert thread.is_alive()
        stop.set()
        thread.join(5)
    with MetricsReader(tmp_path / "metrics.sqlite") as reader:
        [validation] = reader.validations()
        [checkpoint] = reader.checkpoints()
    assert checkpoint.best and checkpoint.epoch == 2 and checkpoint.top1 == validation.top1
    # The best checkpoint holds exactly the validated weights.
    saved = load_checkpoint(tmp_path / "checkpoints")
    assert saved.epoch == 2
    assert evaluate(saved.build_model(), loader)["top1"] == validation.top1


def test_once_no_peer_trains_the_validator_takes_and_validates_the_last_peers_state_whatever_every_says(tmp_path):
    """The last peers keep their state up for the coordinator before they leave (hivetrain.hand_over): it downloads
    that state once its look finds no peer training, though no validation is due, and validates it, once; also when
    their epoch is beyond its count (a rollback's state is served ahead of it)."""
    loader = make_datamodule(CONFIG, val_limit=64).val_dataloader()
    holder = FlakyHolder(failures=3)  # each download moves it 2 epochs on; the first 3 fail
    swarm_epoch, last_peers = [2], [None]
    with MetricsWriter(tmp_path / "metrics.sqlite") as writer:
        validator = Validator(holder, loader, writer, LocalCheckpointStore(tmp_path / "checkpoints"),
                              swarm_epoch=lambda: swarm_epoch[0], every=10, backoff=0.01, report=lambda line: None,
                              last_peers_epoch=lambda: last_peers[0])
        assert validator.tick() is None and validator.tick() is None  # 3 attempts failed: it waits for news
        last_peers[0] = 2  # the news: the last peers left at epoch 2 and wait for this coordinator to take it
        assert validator.tick().epoch == 2
        last_peers[0], swarm_epoch[0] = None, 4
        assert validator.tick() is None and holder.epoch == 2  # 2 epochs on, with 10 between validations
        last_peers[0] = 4
        row = validator.tick()
        assert row is not None and row.epoch == holder.epoch == 4
        assert validator.tick() is None and holder.epoch == 4  # nothing newer: no second download or validation
        last_peers[0] = 6  # the count stays at 4, the last peers went on from a rollback's state served as epoch 5
        row = validator.tick()
        assert row is not None and row.epoch == holder.epoch == 6
