"""W&B beside TensorBoard, offline as the tests run it: a baseline's run, the coordinator's monitor and validator, and
a coordinator started with --wandb-project land in W&B's own run file (read back here record by record), and a
server that cannot be reached costs one warning line, not the run."""

from __future__ import annotations

import argparse
import json
import logging
import re
import struct
import sys
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter
from wandb.proto import wandb_internal_pb2

from conftest import start_coordinator
from hivetrain.roles.coordinator.swarm_monitor import SwarmMonitor
from hivetrain.roles.coordinator.validator import Validator
from hivetrain.checkpoint import LocalCheckpointStore
from hivetrain.data import make_datamodule
from hivetrain.metrics_store import MetricsWriter
from hivetrain.run_result import read_result
from hivetrain.telemetry import publish_peer_record
from hivetrain.wandb_run import WandbScalars, open_wandb_run
from test_baselines import results_in, run
from test_coordinator import CONFIG as RESUMED, EPOCH, _trained_checkpoint
from test_monitor import CONFIG, FlakyHolder, _dht, _record

BASELINE = ["--strategy", "single", "--preset", "demo", "--threads", "1", "--batch-size", "256", "--epochs", "1",
            "--val-limit", "64", "--progress-bar", "off", "--wandb-project", "test"]


def read_wandb_run(run_dir: Path) -> tuple:
    """The run's header (project, name, tags), history rows and final summary, from its `.wandb` file: LevelDB's log
    format (32 KiB blocks of records with a 7-byte header, long ones in pieces) after W&B's own 7-byte header, each
    record a wandb_internal.proto Record. (wandb has no Python reader of its own any more.) wandb-core writes the file
    behind the run: `finish()` can return before it has, so this waits for the run's last record, its exit."""
    [path] = run_dir.glob("run-*.wandb")
    deadline = time.monotonic() + 30
    while not (records := _records(path.read_bytes())) or records[-1].WhichOneof("record_type") != "exit":
        assert time.monotonic() < deadline, f"{path} has no exit record: {[r.WhichOneof('record_type') for r in records]}"
        time.sleep(0.2)

    def values(items) -> dict:
        return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}

    header = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    history = [values(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update(values(r.summary.update))
    return header, history, summary


def _records(data: bytes) -> list:
    records, pending, position, block = [], b"", 7, 32 * 1024
    assert data[:4] in (b"", b":W&B"), data[:7]
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0 or position + 7 + length > len(data):  # the end, or a piece not written yet
            break
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL, or the LAST piece of a FIRST, MIDDLE..., LAST record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_a_baseline_logs_to_an_offline_wandb_run_in_its_out_dir(tmp_path):
    done = run([*BASELINE, "--out-dir", str(tmp_path), "--wandb-run-name", "tiny", "--wandb-tags", "ci", "demo"],
               WANDB_MODE="offline")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [run_dir] = (tmp_path / "wandb").glob("offline-run-*")
    assert f"W&B: offline run in {run_dir}" in done.stdout
    run_result = read_result(results_in(tmp_path)[0])
    header, history, summary = read_wandb_run(run_dir)
    assert (header.project, header.display_name, list(header.tags)) == ("test", "tiny", ["ci", "demo"])
    validations = [row for row in history if "val/top1" in row]
    assert [row["val/top1"] for row in validations] == [point.top1 for point in run_result.validation]
    assert all("trainer/global_step" in row for row in history)  # Lightning's x-axis, as with its own wandb.init
    assert any("train/loss" in row for row in history)
    assert (summary["best/top1"], summary["best/checkpoint"]) == (run_result.best_top1, run_result.best_checkpoint)
    assert summary["best/epoch"] == 1


def test_the_coordinators_monitor_and_validator_write_tensorboard_and_wandb_alike(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    args = argparse.Namespace(wandb_project="test", wandb_entity=None, wandb_run_name=None, wandb_tags=["swarm"])
    lines = []
    wandb_run = open_wandb_run(args, tmp_path, CONFIG.run_id, CONFIG.to_dict(), "swarm/epoch", report=lines.append)
    assert wandb_run is not None and lines == [f"W&B: offline run in {wandb_run.sync_dir} (`wandb sync` uploads it)"]
    loggers = [SummaryWriter(str(tmp_path / "tensorboard")), WandbScalars(wandb_run, step_metric="swarm/epoch")]
    peer = _dht()
    coordinator = _dht(peer)
    try:
        publish_peer_record(peer, CONFIG.run_id, _record("alice", 640), wait=True)
        with MetricsWriter(tmp_path / "metrics.sqlite") as writer:
            monitor = SwarmMonitor(coordinator, CONFIG, writer, loggers)
            snapshot = monitor.refresh()
            assert (snapshot.epoch, snapshot.alive_peers) == (3, 1)
            # the validator downloads epoch 2 after the monitor logged epoch 3: W&B keeps it all the same
            validator = Validator(FlakyHolder(failures=0), make_datamodule(CONFIG, val_limit=64).val_dataloader(),
                                  writer, LocalCheckpointStore(tmp_path / "checkpoints"), every=1,
                                  swarm_epoch=lambda: monitor.latest.epoch, loggers=loggers, report=lambda line: None)
            validation = validator.tick()
    finally:
        coordinator.shutdown()
        peer.shutdown()
    for scalars in loggers:
        scalars.close()
    assert validation is not None and validation.epoch == 2
    [best] = [entry for entry in LocalCheckpointStore(tmp_path / "checkpoints").list() if entry.top1 is not None]

    header, history, summary = read_wandb_run(Path(wandb_run.sync_dir))
    assert (header.project, header.display_name, list(header.tags)) == ("test", CONFIG.run_id, ["swarm"])
    # (tag, swarm epoch) -> value, W&B's own keys (_step, _runtime, ...) left out
    logged = {(tag, row["swarm/epoch"]): value for row in history for tag, value in row.items()
              if not tag.startswith("_") and tag != "swarm/epoch"}
    assert {tag: value for (tag, epoch), value in logged.items() if epoch == 3} == {
        "swarm/alive_peers": 1, "swarm/samples_per_second": 10.0, "swarm/mean_loss": 0.5}
    assert {tag: value for (tag, epoch), value in logged.items() if epoch == 2} == {
        "val/top1": validation.top1, "val/top5": validation.top5, "val/loss": validation.loss,
        "checkpoint/best_top1": validation.top1, "checkpoint/best_epoch": 2}
    assert (summary["checkpoint/best_uri"], summary["checkpoint/best_epoch"]) == (best.uri, 2)

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tensorboard = {(tag, event.step): event.value for tag in events.Tags()["scalars"] for event in events.Scalars(tag)}
    assert tensorboard == pytest.approx(logged)  # float32 there


def test_a_coordinator_started_with_a_wandb_project_logs_validation_and_the_best_checkpoint(spawn, tmp_path,
                                                                                            monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # the coordinator's environment
    LocalCheckpointStore(tmp_path / "saved").save(_trained_checkpoint(), best=True)
    # Resumed, it validates the checkpoint's state at once: no peer needs to train.
    coordinator, _ = start_coordinator(spawn, tmp_path, "--preset", "demo", "--run-id", RESUMED.run_id, "--resume",
                                       str(tmp_path / "saved"), "--val-limit", "64", "--wandb-project", "test")
    run_dir = Path(coordinator.wait_for(r"^W&B: offline run in (\S+) ", timeout=60).group(1))
    assert run_dir.parent == tmp_path / "coordinator" / "wandb"
    uri = coordinator.wait_for(r"^best checkpoint: (.+)$", timeout=90).group(1)
    top1 = float(coordinator.wait_for(rf"^validation at swarm epoch {EPOCH}: top-1 ([\d.]+)", timeout=1).group(1))
    coordinator.leave(timeout=60)  # SIGTERM, as Ctrl-C: the coordinator finishes its W&B run on the way out
    assert coordinator.popen.returncode == 0, coordinator.lines[-20:]
    # wandb's own log stays in its debug.log: the console has the coordinator's lines only
    assert not any(re.search(r"(^|\s)wandb[:.]", line) or "Traceback" in line for line in coordinator.lines), \
        coordinator.lines
    header, history, summary = read_wandb_run(run_dir)
    assert (header.project, header.display_name) == ("test", RESUMED.run_id)
    [validation] = [row for row in history if "val/top1" in row]
    assert (validation["swarm/epoch"], validation["val/top1"]) == (EPOCH, pytest.approx(top1, abs=5e-5))  # printed
    assert any(row.get("swarm/alive_peers") == 0 and row["swarm/epoch"] == EPOCH for row in history)
    assert (summary["checkpoint/best_uri"], summary["checkpoint/best_top1"], summary["checkpoint/best_epoch"]) == (
        uri, validation["val/top1"], EPOCH)


def test_an_unreachable_wandb_server_costs_one_warning_and_the_run_goes_on_offline(tmp_path):
    # A key that looks real, for a server that refuses at once; wandb gives up after WANDB_INIT_TIMEOUT seconds.
    done = run([*BASELINE, "--out-dir", str(tmp_path)], WANDB_MODE="online", WANDB_API_KEY="x" * 40,
               WANDB_BASE_URL="http://127.0.0.1:9", WANDB_INIT_TIMEOUT="1", WANDB_CONFIG_DIR=str(tmp_path / "config"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    output = (done.stdout + done.stderr).splitlines()
    warnings = [line for line in output if "W&B" in line]
    assert len(warnings) == 1 and warnings[0].startswith("W&B could not start online ("), output
    [run_dir] = (tmp_path / "wandb").glob("offline-run-*")
    assert f"logging offline to {run_dir}" in warnings[0]
    _, _, summary = read_wandb_run(run_dir)
    assert summary["best/top1"] == read_result(results_in(tmp_path)[0]).best_top1


def test_without_the_wandb_package_one_warning_and_no_wandb(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` meets where the package is not installed
    args = argparse.Namespace(wandb_project="test", wandb_entity=None, wandb_run_name=None, wandb_tags=None)
    with caplog.at_level(logging.WARNING):
        assert open_wandb_run(args, tmp_path, "run", {}, "step", report=lambda line: None) is None
    assert [r.getMessage() for r in caplog.records] == [
        "W&B logging is off: the wandb package is missing (pip install -e '.[wandb]' in a clone, or"
        " 'hivetrain[wandb] @ WHEEL_OR_GIT_ADDRESS')"]
    assert not (tmp_path / "wandb").exists()
