import math
import os
import sqlite3
import threading

import pytest

from hivetrain.metrics_store import (
    SCHEMA_VERSION,
    CheckpointRow,
    MetricsReader,
    MetricsWriter,
    PeerRow,
    RunInfo,
    StoreBusy,
    StoreError,
    StoreMissing,
    SwarmSnapshot,
    ValidationRow,
)

RUN = RunInfo(run_id="tiny-7f3a", preset="tiny", fingerprint="ab12cd", config_json='{"lr": 0.1}',
              join_command="python peers/join.py --initial-peers /ip4/127.0.0.1/tcp/4000/p2p/Qm",
              coordinator_peer_id="QmCoordinator", started=1_700_000_000.25)


def peer(peer_id: str, name: str, samples: int, first_seen: float = 100.0, **changes) -> PeerRow:
    row = PeerRow(peer_id=peer_id, name=name, hardware="NVIDIA A100 (40 GiB)", client_mode=False, epoch=3,
                  samples_per_second=812.5, loss=2.25, samples=samples, first_seen=first_seen, last_seen=160.5)
    for key, value in changes.items():
        setattr(row, key, value)
    return row


def snapshot(time: float, **changes) -> SwarmSnapshot:
    row = SwarmSnapshot(time=time, epoch=4, alive_peers=3, clients=1, samples_per_second=1500.75,
                        samples_accumulated=2048, target_batch_size=4096, eta_seconds=1.5, mean_loss=2.125)
    for key, value in changes.items():
        setattr(row, key, value)
    return row


def test_round_trip_of_every_row_type(tmp_path):
    path = tmp_path / "nested" / "dir" / "metrics.sqlite"  # the writer creates the parent directories
    peers = [peer("QmA", "alpha", 300, client_mode=True, loss=None), peer("QmB", "beta", 100)]
    snapshots = [snapshot(10.0), snapshot(20.5, eta_seconds=None, mean_loss=None)]
    validations = [ValidationRow(time=30.0, epoch=2, loss=3.5, top1=0.25, top5=0.625, samples=10_000)]
    checkpoints = [CheckpointRow(time=31.0, epoch=2, uri="s3://bucket/run/epoch-2.pt", size_bytes=123_456_789,
                                 top1=0.25, best=True),
                   CheckpointRow(time=40.0, epoch=3, uri="file:///tmp/epoch-3.pt", size_bytes=42, top1=None,
                                 best=False)]
    with MetricsWriter(path) as writer:
        writer.set_run(RUN)
        writer.upsert_peers(peers)
        for row in snapshots:
            writer.add_snapshot(row)
        for row in validations:
            writer.add_validation(row)
        for row in checkpoints:
            writer.add_checkpoint(row)
    with MetricsReader(path) as reader:
        assert reader.run() == RUN
        assert reader.peers() == peers
        assert reader.snapshots() == snapshots
        assert reader.validations() == validations
        assert reader.checkpoints() == checkpoints
        assert [type(row.best) for row in reader.checkpoints()] == [bool, bool]
        assert type(reader.peers()[0].client_mode) is bool
        assert reader.connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_set_run_replaces_the_one_row(tmp_path):
    path = tmp_path / "metrics.sqlite"
    with MetricsWriter(path) as writer:
        writer.set_run(RUN)
        writer.set_run(RunInfo(**{**RUN.__dict__, "run_id": "tiny-restarted", "started": 1_700_000_500.0}))
    with MetricsReader(path) as reader:
        assert reader.run().run_id == "tiny-restarted"
        assert reader.connection.execute("SELECT count(*) FROM run").fetchone()[0] == 1


def test_a_restarted_coordinator_finds_the_epoch_it_last_counted_for_its_own_run_only(tmp_path):
    path = tmp_path / "metrics.sqlite"
    with MetricsWriter(path) as writer:
        assert writer.last_counted_epoch(RUN.run_id) is None  # a new store
        writer.set_run(RUN)
        assert writer.last_counted_epoch(RUN.run_id) is None  # no look yet
        for time, epoch in ((10.0, 7), (20.0, 512), (30.0, 511)):
            writer.add_snapshot(snapshot(time, epoch=epoch))
    with MetricsWriter(path) as writer:
        assert writer.last_counted_epoch(RUN.run_id) == 512
        assert writer.last_counted_epoch("another-run") is None


def test_upsert_keeps_first_seen_and_replaces_the_rest(tmp_path):
    path = tmp_path / "metrics.sqlite"
    with MetricsWriter(path) as writer:
        writer.upsert_peers([peer("QmA", "alpha", 100, first_seen=50.0), peer("QmB", "beta", 200, first_seen=60.0)])
        writer.upsert_peers([
            peer("QmA", "alpha-renamed", 500, first_seen=90.0, epoch=7, loss=1.5, last_seen=300.0, client_mode=True),
            peer("QmB", "beta", 200, first_seen=40.0),  # an earlier first_seen wins: the smaller of old and new
            peer("QmC", "gamma", 200, first_seen=70.0),
        ])
    with MetricsReader(path) as reader:
        assert reader.peers() == [
            peer("QmA", "alpha-renamed", 500, first_seen=50.0, epoch=7, loss=1.5, last_seen=300.0, client_mode=True),
            peer("QmB", "beta", 200, first_seen=40.0),
            peer("QmC", "gamma", 200, first_seen=70.0),  # same samples as beta: ordered by name
        ]


def test_one_best_checkpoint(tmp_path):
    path = tmp_path / "metrics.sqlite"
    with MetricsWriter(path) as writer:
        for epoch, best in enumerate([True, True, False, True, False]):
            writer.add_checkpoint(CheckpointRow(time=float(epoch), epoch=epoch, uri=f"s3://b/{epoch}.pt",
                                                size_bytes=10, top1=0.1 * epoch, best=best))
    with MetricsReader(path) as reader:
        assert [row.best for row in reader.checkpoints()] == [False, False, False, True, False]


def test_best_validation_is_highest_top1_earliest_on_ties(tmp_path):
    path = tmp_path / "metrics.sqlite"
    with MetricsWriter(path) as writer:
        for time, top1 in [(1.0, 0.25), (2.0, 0.5), (3.0, 0.5), (4.0, 0.375)]:
            writer.add_validation(ValidationRow(time=time, epoch=int(time), loss=1.0, top1=top1, top5=0.9, samples=8))
    with MetricsReader(path) as reader:
        assert reader.best_validation() == ValidationRow(time=2.0, epoch=2, loss=1.0, top1=0.5, top5=0.9, samples=8)


def test_snapshots_since_is_exclusive_and_ordered_by_time(tmp_path):
    path = tmp_path / "metrics.sqlite"
    with MetricsWriter(path) as writer:
        for time in [30.0, 10.0, 20.0]:
            writer.add_snapshot(snapshot(time))
    with MetricsReader(path) as reader:
        assert [row.time for row in reader.snapshots()] == [10.0, 20.0, 30.0]
        assert [row.time for row in reader.snapshots(since=10.0)] == [20.0, 30.0]
        assert reader.snapshots(since=30.0) == []


def test_second_writer_is_refused_until_the_first_closes(tmp_path):
    path = tmp_path / "metrics.sqlite"
    first = MetricsWriter(path)
    first.set_run(RUN)
    with pytest.raises(StoreBusy, match=rf"written by another coordinator \(pid {os.getpid()}\)"):
        MetricsWriter(path)
    first.add_validation(ValidationRow(time=1.0, epoch=1, loss=2.0, top1=0.5, top5=0.75, samples=100))
    first.close()
    with MetricsWriter(path) as second:
        second.add_validation(ValidationRow(time=2.0, epoch=2, loss=1.5, top1=0.625, top5=0.875, samples=100))
        with MetricsReader(path) as reader:
            assert reader.run() == RUN
            assert [row.epoch for row in reader.validations()] == [1, 2]


def test_writer_serialises_two_threads(tmp_path):
    with MetricsWriter(tmp_path / "metrics.sqlite") as writer:
        def write(offset: float) -> None:
            for index in range(50):
                writer.add_snapshot(snapshot(offset + index))
        threads = [threading.Thread(target=write, args=(offset,)) for offset in (0.0, 1000.0)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        with MetricsReader(writer.path) as reader:
            assert len(reader.snapshots()) == 100


def test_reader_on_a_missing_file_creates_nothing(tmp_path):
    with pytest.raises(StoreMissing):
        MetricsReader(tmp_path / "metrics.sqlite")
    assert list(tmp_path.iterdir()) == []


def test_reader_cannot_write(tmp_path):
    path = tmp_path / "metrics.sqlite"
    with MetricsWriter(path) as writer:
        writer.add_validation(ValidationRow(time=1.0, epoch=1, loss=2.0, top1=0.5, top5=0.75, samples=100))
    with MetricsReader(path) as reader:
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            reader.connection.execute("DELETE FROM validations")
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            reader.connection.execute("CREATE TABLE intruder (x)")
        assert len(reader.validations()) == 1


def test_reader_path_with_uri_characters(tmp_path):
    path = tmp_path / "run #1?x=y%20" / "metrics.sqlite"
    with MetricsWriter(path) as writer:
        writer.set_run(RUN)
    with MetricsReader(path) as reader:
        assert reader.run() == RUN


def test_reader_sees_rows_committed_after_it_opened(tmp_path):
    path = tmp_path / "metrics.sqlite"
    with MetricsWriter(path) as writer:
        writer.add_snapshot(snapshot(1.0))
        with MetricsReader(path) as reader:
            assert [row.time for row in reader.snapshots()] == [1.0]
            writer.add_snapshot(snapshot(2.0))
            writer.upsert_peers([peer("QmA", "alpha", 10)])
            assert [row.time for row in reader.snapshots()] == [1.0, 2.0]
            assert [row.name for row in reader.peers()] == ["alpha"]


@pytest.mark.parametrize("kind", ["empty file", "database without tables"])
def test_reader_before_the_schema_exists_returns_nothing(tmp_path, kind):
    path = tmp_path / "metrics.sqlite"
    if kind == "empty file":
        path.touch()  # what the writer's connect leaves for a moment
    else:
        connection = sqlite3.connect(path)
        connection.execute("PRAGMA journal_mode=WAL")
        connection.close()
    with MetricsReader(path) as reader:
        assert reader.run() is None
        assert reader.peers() == []
        assert reader.snapshots() == []
        assert reader.snapshots(since=0.0) == []
        assert reader.validations() == []
        assert reader.checkpoints() == []
        assert reader.best_validation() is None
        with MetricsWriter(path) as writer:  # the writer then starts: the same reader sees its rows
            writer.add_snapshot(snapshot(5.0))
        assert [row.time for row in reader.snapshots()] == [5.0]


def test_nan_is_stored_as_null(tmp_path):
    path = tmp_path / "metrics.sqlite"
    with MetricsWriter(path) as writer:
        writer.upsert_peers([peer("QmA", "alpha", 10, loss=math.nan)])
        writer.add_snapshot(snapshot(1.0, mean_loss=math.nan))
        writer.add_validation(ValidationRow(time=1.0, epoch=1, loss=math.nan, top1=0.5, top5=0.75, samples=100))
    with MetricsReader(path) as reader:
        assert reader.peers()[0].loss is None
        assert reader.snapshots()[0].mean_loss is None
        assert math.isnan(reader.validations()[0].loss)  # a float that cannot be None reads back as NaN
        assert reader.connection.execute("SELECT count(*) FROM peers WHERE loss IS NULL").fetchone()[0] == 1
        assert reader.connection.execute("SELECT count(*) FROM validations WHERE loss IS NULL").fetchone()[0] == 1


def test_schema_version_mismatch(tmp_path):
    path = tmp_path / "metrics.sqlite"
    with MetricsWriter(path) as writer:
        writer.set_run(RUN)
    connection = sqlite3.connect(path)
    with connection:
        connection.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (SCHEMA_VERSION + 1,))
    connection.close()
    names_both = rf"version {SCHEMA_VERSION + 1}\b.*version {SCHEMA_VERSION}\b"
    with pytest.raises(StoreError, match=names_both):
        MetricsWriter(path)
    with MetricsReader(path) as reader, pytest.raises(StoreError, match=names_both):
        reader.run()
    with pytest.raises(StoreError, match=names_both):  # not StoreBusy: the refused writer released its lock
        MetricsWriter(path)
