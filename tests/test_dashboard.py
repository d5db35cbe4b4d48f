"""The dashboard against fixture metrics stores, through Streamlit's AppTest, and its pure helpers directly."""

import dataclasses
import importlib.util
import re
import shutil
import sqlite3
import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from hivetrain.config import get_preset
from hivetrain.metrics_store import (CheckpointRow, MetricsWriter, PeerRow, RollbackRow, RunInfo, SwarmSnapshot,
                                     ValidationRow)
from hivetrain.run_result import read_result

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "hivetrain" / "roles" / "dashboard" / "app.py"
CHART = "vega_lite_chart"  # what AppTest calls an st.altair_chart in this Streamlit version

# The app is a script, not on sys.path: load it as a module for its helpers (main() runs only as __main__).
_spec = importlib.util.spec_from_file_location("dashboard_app", APP)
app = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(app)


def run_app(monkeypatch, store: Path, results: Path) -> AppTest:
    monkeypatch.setattr("sys.argv", ["app.py", "--store", str(store), "--results", str(results)])
    at = AppTest.from_file(str(APP), default_timeout=30).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def write_run(path: Path, peers: list[PeerRow], top1s: list[float], checkpoints: list[CheckpointRow] = (),
              config=get_preset("demo"), target: int = 128) -> None:
    """A demo-preset run: the given peers, five snapshots (epochs 0..4) of 64 samples toward `target`, and one
    validation per top-1 (epochs 1..)."""
    now = time.time()
    with MetricsWriter(path) as writer:
        writer.set_run(RunInfo("hivetrain-demo", "demo", config.fingerprint, config.to_json(),
                               "python peers/join.py --initial-peers /ip4/1.2.3.4/tcp/31337/p2p/Qm", "QmCoordinator",
                               now - 600))
        writer.upsert_peers(peers)
        for epoch in range(5):
            writer.add_snapshot(SwarmSnapshot(now - 50 + 10 * epoch, epoch, 2, 1, 100.0 + 10 * epoch, 64, target, 12.0,
                                              2.0 - 0.3 * epoch))
        for epoch, top1 in enumerate(top1s, 1):
            writer.add_validation(ValidationRow(now - 60 + 10 * epoch, epoch, 1.0 / epoch, top1, top1 + 0.02, 360))
        for checkpoint in checkpoints:
            writer.add_checkpoint(checkpoint)


def peer(name: str, samples: int, last_seen_ago: float, client: bool = False) -> PeerRow:
    now = time.time()
    return PeerRow(f"Qm{name}PeerIdentity", name, "cpu: 2 cores", client, 4, 40.0, 0.8, samples, now - 900,
                   now - last_seen_ago, train_seconds=samples / 10, swarm_seconds=samples / 100)


def metric(at: AppTest, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


# --- empty stores -----------------------------------------------------------------------------------------------


def test_missing_store_waits_for_the_coordinator(monkeypatch, tmp_path):
    at = run_app(monkeypatch, tmp_path / "nothing.sqlite", tmp_path)
    assert any("Waiting for the coordinator" in i.value for i in at.info)
    assert not at.metric


def test_store_without_a_run_counts_as_empty(monkeypatch, tmp_path):
    MetricsWriter(tmp_path / "metrics.sqlite").close()  # schema only: a coordinator still starting
    at = run_app(monkeypatch, tmp_path / "metrics.sqlite", tmp_path)
    assert any("Waiting for the coordinator" in i.value for i in at.info)


def test_other_store_errors_are_shown(monkeypatch, tmp_path):
    (tmp_path / "metrics.sqlite").write_text("not a database, but long enough to look like one " * 50)
    at = run_app(monkeypatch, tmp_path / "metrics.sqlite", tmp_path)
    assert at.error and "metrics.sqlite" in at.error[0].value


def test_store_of_another_schema_version_is_an_error(monkeypatch, tmp_path):
    MetricsWriter(tmp_path / "metrics.sqlite").close()
    db = sqlite3.connect(tmp_path / "metrics.sqlite", isolation_level=None)  # autocommit
    db.execute("UPDATE meta SET value = 99 WHERE key = 'schema_version'")
    db.close()
    at = run_app(monkeypatch, tmp_path / "metrics.sqlite", tmp_path)
    assert at.error and "schema version 99" in at.error[0].value


# --- a running swarm --------------------------------------------------------------------------------------------


def test_running_swarm(monkeypatch, tmp_path):
    store = tmp_path / "metrics.sqlite"
    peers = [peer("alpha", 900, 3), peer("bravo", 1500, 4, client=True), peer("charlie", 300, 60)]
    write_run(store, peers, [0.5, 0.7, 0.9, 0.85])
    at = run_app(monkeypatch, store, tmp_path)

    assert [h.value for h in at.header] + [s.value for s in at.subheader] == [
        "Swarm overview", "Peers", "Contributions", "Training", "Validation", "Checkpoints", "Baselines"]
    assert metric(at, "Swarm epoch") == "4"
    assert metric(at, "Alive peers") == "2"
    assert metric(at, "Clients") == "1"
    assert metric(at, "Best top-1") == app.fmt_pct(0.9) == "90.00%"
    assert any(re.search(r'title="[-\d: ]+ UTC">last updated 1\d s ago', c.value) for c in at.caption)
    assert at.code[0].value.startswith("python peers/join.py")

    table = at.dataframe[0].value
    assert list(table.columns) == app.PEER_COLUMNS
    assert sorted(table["state"]) == ["online", "online", "stale"]
    assert dict(zip(table["name"], table["contributed"])) == {"alpha": 900, "bravo": 1500, "charlie": 300}
    assert dict(zip(table["name"], table["client mode"])) == {"alpha": "no", "bravo": "yes", "charlie": "no"}
    assert set(table["peer"]) == {"QmalphaP…", "QmbravoP…", "Qmcharli…"}
    assert set(table["in swarm rounds"]) == {"10%"}  # of each peer's training time

    board = at.dataframe[1].value
    assert list(board["name"]) == ["bravo", "alpha", "charlie"]
    assert list(board["rank"]) == [1, 2, 3]
    assert list(board["share %"]) == [55.6, 33.3, 11.1]

    charts = at.get(CHART)
    assert len(charts) == 1 + 3 + 2  # contributions, training, validation accuracy and loss
    assert '"shape": "diamond"' in charts[4].proto.spec  # the best point marked on the accuracy chart
    assert any("swarm epoch **3**" in m.value for m in at.markdown)
    assert any("No checkpoint yet" in c.value for c in at.caption)
    [progress] = at.get("progress")
    assert progress.proto.text == "64 of 128 samples toward swarm epoch 5" and progress.proto.value == 50


def test_a_round_paced_in_seconds_shows_its_samples_alone_before_its_size_is_known(monkeypatch, tmp_path):
    """A round paced in seconds is what the swarm trains in that time: the coordinator stores a target of 0 until the
    peers' records state a rate, and the dashboard shows no "64 of 1" for it."""
    store = tmp_path / "metrics.sqlite"
    write_run(store, [peer("alpha", 900, 3)], [0.5], target=0)
    [progress] = run_app(monkeypatch, store, tmp_path).get("progress")
    assert progress.proto.text == "64 samples toward swarm epoch 5" and progress.proto.value == 0


def test_a_diloco_run_shows_outer_rounds_and_what_its_peers_send(monkeypatch, tmp_path):
    store = tmp_path / "metrics.sqlite"
    config = get_preset("demo")
    config = config.replace(swarm=dataclasses.replace(config.swarm, mode="diloco", inner_steps=20,
                                                      target_group_size=4))
    fast, slow = peer("alpha", 900, 3), peer("bravo", 300, 4)
    fast.inner_steps, fast.pseudo_gradient_norm, fast.round_bytes = 23, 0.4172, 4_000_000
    slow.inner_steps, slow.pseudo_gradient_norm, slow.round_bytes = 7, 0.3001, 4_000_000
    fast.rounds_averaged, fast.rounds_alone, fast.rounds_failed = 3, 1, 0
    slow.left_at = time.time() - 2  # the coordinator's last look found it gone
    write_run(store, [fast, slow], [0.5, 0.7], config=config)
    at = run_app(monkeypatch, store, tmp_path)

    assert metric(at, "Outer round") == "4"
    assert ("diloco: 20 inner steps per outer round, outer lr 1, momentum 0, averaging in groups of at most 4"
            in at.caption[0].value)
    table = at.dataframe[0].value
    assert list(table.columns) == app.PEER_COLUMNS + app.DILOCO_COLUMNS
    assert dict(zip(table["name"], table["inner steps"])) == {"alpha": 23, "bravo": 7}
    assert dict(zip(table["name"], table["pseudo-gradient norm"])) == {"alpha": 0.4172, "bravo": 0.3001}
    assert list(table["MB per round"]) == [4.0, 4.0]
    assert list(table["rounds averaged / alone / failed"].fillna("-")) == ["3 / 1 / 0", "-"]  # bravo: none reported
    assert dict(zip(table["name"], table["state"])) == {"alpha": "online", "bravo": "left"}


def test_validation_against_wall_time(monkeypatch, tmp_path):
    store = tmp_path / "metrics.sqlite"
    write_run(store, [peer("alpha", 900, 3)], [0.5, 0.7])
    at = run_app(monkeypatch, store, tmp_path)
    at.radio[0].set_value("wall time").run()
    assert not at.exception
    assert at.radio[0].value == "wall time"
    assert '"type": "temporal"' in at.get(CHART)[4].proto.spec


def test_a_rollback_is_marked_on_the_accuracy_chart_and_listed(monkeypatch, tmp_path):
    store = tmp_path / "metrics.sqlite"
    write_run(store, [peer("alpha", 900, 3)], [0.5, 0.8, 0.1])
    rolled_back = time.time() - 25
    with MetricsWriter(store) as writer:  # the validation of epoch 3 fell to 10%: back to epoch 2's state
        writer.add_rollback(RollbackRow(rolled_back, 1, 3, 0.1, float("nan"), 2, 0.8, 6))
    at = run_app(monkeypatch, store, tmp_path)
    assert any("**1 rollback** to the best validated state" in m.value for m in at.markdown)
    table = at.dataframe[-1].value
    assert table.to_dict("records") == [{"at swarm epoch": 3, "time": app.utc(rolled_back), "top-1": "10.00%",
                                         "loss": "nan", "back to epoch": 2, "its top-1": "80.00%",
                                         "served as epoch": 6}]
    accuracy = at.get(CHART)[4].proto
    assert '"mark": {"type": "rule"' in accuracy.spec and "back to epoch 2" in str(accuracy)  # its data: a dataset


# --- a finished run ---------------------------------------------------------------------------------------------


@pytest.fixture
def finished(tmp_path):
    now = time.time()
    store = tmp_path / "metrics.sqlite"
    local = str(tmp_path / "checkpoints" / "ckpt-000002.tar")
    write_run(store, [peer("alpha", 900, 300), peer("bravo", 1500, 3600)], [0.5, 0.7, 0.9, 0.95], [
        CheckpointRow(now - 400, 2, local, 6_000_000, 0.7, True),
        CheckpointRow(now - 200, 4, "s3://bucket/run/ckpt-000004.tar", 6_000_000, 0.95, True),
    ])
    return store


def test_finished_run_with_checkpoints(monkeypatch, tmp_path, finished):
    at = run_app(monkeypatch, finished, tmp_path / "no-results")
    assert set(at.dataframe[0].value["state"]) == {"gone"}

    checkpoints = at.dataframe[2].value
    assert list(checkpoints.columns) == ["epoch", "uri", "size", "top-1", "time", "best"]
    assert list(checkpoints["uri"]) == [str(tmp_path / "checkpoints" / "ckpt-000002.tar"),
                                        "s3://bucket/run/ckpt-000004.tar"]
    assert list(checkpoints["best"]) == ["", "★"]
    assert list(checkpoints["size"]) == ["5.7 MiB", "5.7 MiB"]
    assert list(checkpoints["time"]) == ["6 min ago", "3 min ago"]

    assert any("No baseline runs recorded for preset demo" in i.value and "baselines/run.py" in i.value
               for i in at.info)


def test_baselines_compare_results_of_the_same_preset(monkeypatch, tmp_path, finished):
    results = tmp_path / "results"
    results.mkdir()
    for pattern in ("demo-ddp-*.json", "demo-fsdp-*.json"):
        shutil.copy(next((ROOT / "logbook" / "results").glob(pattern)), results)
    (results / "broken.json").write_text("{")
    at = run_app(monkeypatch, finished, results)

    assert any("broken.json" in w.value for w in at.warning)
    table = at.dataframe[3].value
    assert list(table.columns) == ["run", "strategy", "world size", "global batch", "samples/s", "best top-1",
                                   "wall time", "peak memory"]
    speeds = dict(zip(table["strategy"], table["samples/s"]))
    ddp, fsdp = (read_result(next(results.glob(f"demo-{s}-*.json"))) for s in ("ddp", "fsdp"))
    assert speeds == {"ddp": round(ddp.samples_per_s, 1), "fsdp": round(fsdp.samples_per_s, 1),
                      "swarm (this run)": 120.0}  # the mean of the snapshots' 100..140
    swarm = table[table["strategy"] == "swarm (this run)"].iloc[0]
    assert (swarm["world size"], swarm["best top-1"]) == (2, "95.00%")


# --- pure helpers -----------------------------------------------------------------------------------------------


def test_ago():
    assert [app.ago(s) for s in (-2, 0, 3.7, 59, 60, 299, 3599, 3600, 7300, 86400 * 2)] == [
        "0 s ago", "0 s ago", "3 s ago", "59 s ago", "1 min ago", "4 min ago", "59 min ago", "1 h ago", "2 h ago",
        "2 d ago"]


def test_peer_state_boundaries():
    now = 1_000_000.0
    assert [app.peer_state(now - age, now) for age in (0, 30, 30.5, 120, 120.5, 10_000)] == [
        "online", "online", "stale", "stale", "gone", "gone"]
    assert app.peer_state(now, now, left_at=now - 1) == "left"  # the monitor saw it leave: its last record is fresh


def test_human_size():
    assert [app.fmt_bytes(n) for n in (0, 1023, 2048, 6_000_000, 3 * 1024**3)] == [
        "0 B", "1023 B", "2 KiB", "5.7 MiB", "3.00 GiB"]


def test_utc():
    assert app.utc(0) == "1970-01-01 00:00:00 UTC"


# --- hostile but well-formed peer records -------------------------------------------------------------------------

HOSTILE_TEXT = "<script>alert(1)</script> **bold** | a | table |\n# heading \x1b[31m\u202eevil\u0000 " * 400  # 26 kB: two fit the 64-KiB cap
INT64_MAX = 2**63 - 1


def hostile_records() -> list[dict]:
    """Records every reader accepts (signed, of the schema, finite numbers, 64-bit integers, under the size cap) with
    the most awkward values a peer may choose: what the coordinator stores and the dashboard shows as they are."""
    now = time.time()
    base = dict(peer_id="QmHostile", name="hostile", hardware="cpu", client_mode=False, epoch=3,
                samples_per_second=1.0, loss=1.0, samples=1, time=now)
    return [
        {**base, "peer_id": "Qm-markup", "name": HOSTILE_TEXT, "hardware": HOSTILE_TEXT},
        {**base, "peer_id": "", "name": ""},
        {**base, "peer_id": "Qm-huge", "epoch": INT64_MAX, "samples": INT64_MAX, "samples_per_second": 1e308,
         "loss": 1e308, "train_seconds": 0.0, "swarm_seconds": 1e308, "inner_steps": INT64_MAX,
         "pseudo_gradient_norm": 1e308, "round_bytes": INT64_MAX, "rounds_averaged": INT64_MAX, "rounds_alone": 0,
         "rounds_failed": INT64_MAX},
        {**base, "peer_id": "Qm-negative", "loss": -1e308, "samples_per_second": 0.0},
        {**base, "peer_id": "Qm-future", "time": 1e300},
        {**base, "peer_id": "Qm-past", "time": -1e300},
        {**base, "peer_id": "Qm-epoch", "time": 0.0, "left": True},
    ]


def test_the_coordinator_stores_and_the_dashboard_shows_hostile_well_formed_records(monkeypatch, tmp_path):
    import hivemind

    from hivetrain.roles.coordinator.swarm_monitor import SwarmMonitor
    from hivetrain.record_guard import parse_entry
    from hivetrain.telemetry import PeerRecord, publish_peer_record

    config = get_preset("demo")
    config = config.replace(swarm=dataclasses.replace(config.swarm, mode="diloco"))
    records = [PeerRecord(**fields) for fields in hostile_records()]
    assert all(parse_entry(PeerRecord, record.dict()) == (record, None) for record in records)  # readers take them
    store = tmp_path / "metrics.sqlite"
    write_run(store, [], [0.5], config=config)
    peer = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    coordinator = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True,
                               initial_peers=[str(a) for a in peer.get_visible_maddrs()])
    try:
        with MetricsWriter(store) as writer:
            monitor = SwarmMonitor(coordinator, config, writer)
            assert monitor.refresh().alive_peers == 0  # the coordinator is up (and guards the run's keys) first
            for record in records:  # one signing key in this process: one record at a time, each its own store row
                publish_peer_record(peer, config.run_id, record, wait=True)
                assert monitor.refresh().alive_peers == (0 if record.left else 1), record.peer_id
    finally:
        coordinator.shutdown()
        peer.shutdown()

    at = run_app(monkeypatch, store, tmp_path)
    table = at.dataframe[0].value
    assert sorted(table["peer"]) == sorted(r.peer_id[:8] + "…" for r in records)
    assert HOSTILE_TEXT in list(table["name"])  # shown as text, whole
    assert set(table["state"]) <= {"online", "stale", "gone", "left"}
    assert dict(zip(table["peer"], table["state"]))["Qm-epoch…"] == "left"


def test_shown_path(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert app.shown_path(tmp_path / "runs" / "metrics.sqlite") == "runs/metrics.sqlite"
    assert app.shown_path(Path("/elsewhere/metrics.sqlite")) == "/elsewhere/metrics.sqlite"
