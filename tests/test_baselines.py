"""Centralised baselines on CPU: DDP and FSDP take exactly the step one process takes on their combined batch, FSDP
really shards the parameters, two simulated nodes train together and write one result, the batch finder respects its
budget, and bad input fails with one clear line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hivetrain.batch_size import TrialSpec, find_batch_size, parse_bytes, run_trial
from hivetrain.config import get_preset
from hivetrain.run_result import read_result

ROOT = Path(__file__).resolve().parent.parent
BATCH = 16  # per process in the exactness runs; the single-process reference takes 2 * BATCH


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra: str) -> dict[str, str]:
    # PYTHONPATH: `baselines` is importable from the repository root even before it is a pip-installed package.
    # gloo and the rendezvous use loopback only.
    return dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lo",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), **extra)


def run(args: list[str], timeout: float = 180, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "baselines/run.py", *args], cwd=ROOT, env=env(**extra), capture_output=True,
                          text=True, timeout=timeout)


def results_in(directory: Path) -> list[Path]:
    return sorted((directory / "results").glob("*.json"))


# --- one optimizer step: DDP and FSDP against one process ---------------------------------------------------------


@pytest.fixture(scope="module")
def one_step(tmp_path_factory) -> dict[str, Path]:
    """One optimizer step from the preset's initial weights, on the first 2 * BATCH training samples in stored order:
    one process with the whole batch, and 2 processes with BATCH each (rank r takes samples r, r+2, ...)."""
    base = tmp_path_factory.mktemp("one_step")
    common = ["--preset", "demo", "--threads", "1", "--max-steps", "1", "--no-shuffle", "--val-limit", "0",
              "--progress-bar", "off"]
    layouts = {"single": ["--strategy", "single", "--batch-size", str(2 * BATCH)],
               "ddp": ["--strategy", "ddp", "--devices", "2", "--batch-size", str(BATCH)],
               "fsdp": ["--strategy", "fsdp", "--devices", "2", "--batch-size", str(BATCH)]}
    out = {}
    for name, layout in layouts.items():
        result = run([*layout, *common, "--out-dir", str(base / name),
                      "--save-final-weights", str(base / f"{name}.safetensors")])
        assert result.returncode == 0, f"{name} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
        out[name] = base / name
    return out


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_ddp_and_fsdp_take_the_single_process_step(one_step):
    from hivetrain.config import get_preset
    from hivetrain.model import create_model

    weights = {name: load_file(str(path.parent / f"{name}.safetensors")) for name, path in one_step.items()}
    initial = create_model(get_preset("demo").model, seed=get_preset("demo").seed).state_dict()
    # The step is real: AdamW's first step moves each weight by about lr / warmup_steps = 6e-4.
    assert _max_difference(weights["single"], initial) > 1e-4
    # Another batch or a wrong average moves weights the other way (differences of ~1e-3 in a third of them);
    # a different order of floating-point sums stays near 1e-6.
    assert _max_difference(weights["ddp"], weights["single"]) < 1e-5
    assert _max_difference(weights["fsdp"], weights["single"]) < 1e-5


def test_fsdp_shards_parameters_across_ranks(one_step):
    (path,) = results_in(one_step["fsdp"])
    run_result = read_result(path)
    sharding = run_result.sharding
    assert run_result.strategy == "fsdp" and run_result.world_size == 2 and sharding is not None
    assert len(sharding.per_rank_param_bytes) == 2
    assert sum(sharding.per_rank_param_bytes) == sharding.total_param_bytes  # shards partition the model
    for local in sharding.per_rank_param_bytes:
        assert abs(local / sharding.total_param_bytes - 0.5) < 0.03
    (ddp,) = results_in(one_step["ddp"])
    assert read_result(ddp).sharding is None  # DDP replicates: nothing to report


def test_results_of_the_one_step_runs(one_step):
    for name, directory in one_step.items():
        (path,) = results_in(directory)
        run_result = read_result(path)
        assert run_result.strategy == name and run_result.steps == 1 and run_result.train_samples == 2 * BATCH
        assert run_result.global_batch_size == 2 * BATCH and len(run_result.memory) == run_result.world_size
        assert all(m.peak_rss_bytes > 100 * 2**20 for m in run_result.memory)
        assert run_result.command.startswith("python baselines/run.py") or "MASTER_PORT=" in run_result.command


# --- two nodes x two processes on one machine ---------------------------------------------------------------------


def test_two_simulated_nodes_train_and_write_one_result(tmp_path):
    """The ddp_sim recipe: the same command once per node, NODE_RANK 0 and 1, one MASTER_ADDR/MASTER_PORT; Lightning
    starts each node's second process itself."""
    args = [sys.executable, "baselines/run.py", "--strategy", "ddp", "--preset", "demo", "--num-nodes", "2",
            "--devices", "2", "--threads", "1", "--batch-size", "128", "--epochs", "1", "--val-limit", "64",
            "--progress-bar", "off", "--out-dir", str(tmp_path)]
    shared = env()
    nodes = [subprocess.Popen(args, cwd=ROOT, env=dict(shared, NODE_RANK=str(rank)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    try:
        outputs = [node.communicate(timeout=240)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for rank, (node, output) in enumerate(zip(nodes, outputs, strict=True)):
        assert node.returncode == 0, f"node {rank} failed:\n{output[-3000:]}"
    (path,) = results_in(tmp_path)  # exactly one result: global rank 0 writes it
    run_result = read_result(path)
    assert (run_result.num_nodes, run_result.devices_per_node, run_result.world_size) == (2, 2, 4)
    assert [m.rank for m in run_result.memory] == [0, 1, 2, 3]
    # 1,437 training digits / (4 ranks x 128) = 2 full steps of 512 samples, then one validation.
    assert run_result.steps == 2 and run_result.train_samples == 1024 and run_result.global_batch_size == 512
    assert len(run_result.validation) == 1 and 0.0 < run_result.validation[0].top1 <= 1.0
    assert run_result.best_checkpoint and Path(run_result.best_checkpoint).is_file()
    assert "NODE_RANK=0" in run_result.command


# --- batch finder -------------------------------------------------------------------------------------------------


def test_batch_finder_answer_fits_and_twice_does_not(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # for the trial processes
    spec = TrialSpec(get_preset("demo"), "cpu", "32", threads=1, steps=2)
    small = run_trial(spec, 32, None)
    assert small.fits and small.peak_bytes is not None
    # The demo model needs about 0.1 MiB more per sample: this budget lands in the hundreds.
    budget = small.peak_bytes + 100 * 2**20
    result = find_batch_size(spec, budget, start=512, tolerance=0.25, log=lambda _: None)
    fitting = [t for t in result.trials if t.batch_size == result.batch_size]
    assert fitting and fitting[-1].fits and fitting[-1].peak_bytes <= budget
    assert 32 < result.batch_size < result.cap
    double = run_trial(spec, 2 * result.batch_size, budget)
    assert not double.fits


def test_parse_bytes():
    assert parse_bytes("4GiB") == 4 * 2**30 and parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("2GB") == 2 * 10**9 and parse_bytes("1.5G") == int(1.5 * 2**30) and parse_bytes("100") == 100
    for bad in ("four", "4XB", "-1GiB", "0"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


# --- clear errors -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--strategy", "single", "--devices", "2"], "use ddp or fsdp"),
    (["--strategy", "ddp", "--batch-size", "0"], "--batch-size must be a positive integer or 'auto'"),
    (["--strategy", "fsdp", "--precision", "16-mixed"], "supports --precision 32 or bf16-mixed"),
    (["--strategy", "ddp", "--memory-budget", "lots"], "--memory-budget"),
    (["--strategy", "ddp", "--preset", "nope"], "unknown preset 'nope'"),
    (["--strategy", "pipeline", "--devices", "1"], "--strategy pipeline needs 2 or more stages"),
    (["--strategy", "pipeline", "--devices", "2", "--microbatches", "1"], "for --schedule 1f1b at least the 2 stages"),
    (["--strategy", "pipeline", "--devices", "2", "--microbatches", "5"], "does not split into 5 equal micro-batches"),
])
def test_bad_input_fails_with_one_line(args, message, tmp_path):
    result = run([*args, "--out-dir", str(tmp_path)], timeout=60)
    assert result.returncode == 2
    error_lines = [line for line in result.stderr.splitlines() if line.startswith(("error:", "python baselines"))]
    assert any(message in line for line in error_lines), result.stderr
    assert "Traceback" not in result.stderr
    assert not results_in(tmp_path)


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="DataParallel can run here")
def test_dp_without_two_gpus_exits_with_a_message(tmp_path):
    result = run(["--strategy", "dp", "--preset", "demo", "--out-dir", str(tmp_path)], timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: --strategy dp needs at least 2 CUDA GPUs")
    assert not results_in(tmp_path)


def test_help_explains_the_strategies():
    result = subprocess.run([sys.executable, "baselines/run.py", "--help"], cwd=ROOT, env=env(), capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0
    for words in ("--strategy {single,dp,ddp,fsdp,pipeline}", "FSDP2", "DataParallel", "1F1B", "--memory-budget",
                  "NODE_RANK"):
        assert words in " ".join(result.stdout.split()), words


def test_result_file_is_json_with_the_config(one_step):
    (path,) = results_in(one_step["single"])
    raw = json.loads(path.read_text())
    assert raw["config"]["preset"] == "demo" and raw["fingerprint"] and raw["tensorboard_dir"]


def test_best_checkpoint_goes_to_the_s3_store(s3, tmp_path):
    """--checkpoint-store s3://... puts the best checkpoint in the same store the coordinator uses."""
    from conftest import BUCKET

    from hivetrain.checkpoint_location import load_checkpoint

    args = [sys.executable, "baselines/run.py", "--strategy", "single", "--preset", "demo", "--threads", "1",
            "--batch-size", "256", "--epochs", "1", "--val-limit", "64", "--progress-bar", "off",
            "--out-dir", str(tmp_path), "--checkpoint-store", f"s3://{BUCKET}/baselines",
            "--s3-endpoint-url", s3.endpoint_url]
    done = subprocess.run(args, cwd=ROOT, env=dict(env(), **s3.client_env()), capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (path,) = results_in(tmp_path)
    run_result = read_result(path)
    assert run_result.best_checkpoint.startswith(f"s3://{BUCKET}/baselines/")
    checkpoint = load_checkpoint(run_result.best_checkpoint, endpoint_url=s3.endpoint_url)
    assert checkpoint.metrics["top1"] == run_result.best_top1
    assert checkpoint.config.fingerprint == run_result.fingerprint
