"""The GPU proof's runs of benchmarks.gpu_speed, on CPUs: one process, DDP over gloo, with torch.compile and with a
torch.compile that cannot compile (its error in one line, in the proof's result), the options it refuses, and the
control of two plain processes whose timed windows start together (benchmarks/gpu_control.py), with its page.
Everything is written under tmp_path."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import gpu_control, gpu_proof
from benchmarks.gpu_page import render_gpu_page

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_RESULT = ROOT / "tests" / "fixtures" / "gpu-proof-example.json"


def run_module(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


SPEED_ON_CPU = ("--device", "cpu", "--precision", "32", "--batch-size", "2", "--train-samples", "6", "--val-samples",
                "3", "--warmup-steps", "1", "--seconds", "0", "--threads", "1", "--seed", "5")


def _speed(*args: str, exit_codes: tuple[int, ...] = (0,)) -> dict:
    done = run_module("benchmarks.gpu_speed", *SPEED_ON_CPU, *args, timeout=400)
    assert done.returncode in exit_codes, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_speed_measurement_on_one_device():
    result = _speed()
    assert result["strategy"] == "single" and result["devices"] == 1 and not result["out_of_memory"]
    assert result["steps"] >= 2 and result["train_samples"] == 2 * result["steps"]
    # rounded to 0.1 samples/s: on a busy CPU the rate falls under 1, where that rounding is more than 5%
    assert result["train_samples_per_s"] == pytest.approx(result["train_samples"] / result["train_seconds"], rel=0.05,
                                                          abs=0.05)
    assert result["val_samples"] == 3 and result["val_samples_per_s"] > 0
    assert math.isfinite(result["final_loss"])
    assert result["peak_memory_bytes"] == [None]  # a CPU has no CUDA allocator to ask
    assert result["compile"] is False and result["ready_count"] == 1 and result["ready_wait_seconds"] == 0
    assert result["first_step_seconds"] > 0 and result["warmup_seconds"] >= result["first_step_seconds"]
    assert result["window_end_time"] - result["window_start_time"] == pytest.approx(result["train_seconds"], abs=0.05)
    assert time.time() - 400 < result["window_start_time"] < result["window_end_time"] <= time.time()


@pytest.mark.parametrize("args, message", [
    (["--devices", "2", "--compile"], "--compile and --ready-dir are for --devices 1"),
    (["--devices", "2", "--ready-dir", "/tmp", "--ready-count", "2"], "--compile and --ready-dir are for --devices 1"),
    (["--ready-count", "2"], "--ready-count must be at least 1, and more than 1 only with --ready-dir"),
])
def test_speed_refuses_options_it_cannot_honour_in_one_line(args, message):
    done = run_module("benchmarks.gpu_speed", "--device", "cpu", "--precision", "32", "--batch-size", "2", *args)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], done.stderr


def test_speed_measurement_with_torch_compile():
    from benchmarks.gpu_speed import FAILED_EXIT

    result = _speed("--compile", exit_codes=(0, FAILED_EXIT))  # FAILED_EXIT: torch.compile cannot run here
    if result.get("error"):
        pytest.skip(f"torch.compile cannot run on this machine: {result['error']}")
    assert result["compile"] is True and result["steps"] >= 2 and math.isfinite(result["final_loss"])
    # Compilation happens in the first warm-up step, untimed: far longer than the timed steps that follow.
    assert result["first_step_seconds"] > result["train_seconds"] / result["steps"]
    assert result["val_samples"] == 3  # validation runs the eager model


def test_a_torch_compile_that_cannot_compile_fails_in_one_line_and_the_proof_records_it(tmp_path, monkeypatch):
    # Inductor compiles a CPU model with the C++ compiler named by CXX: none there, the first warm-up step fails.
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    clock = gpu_proof.Clock()
    args = gpu_proof.parse_args(["--train-samples", "6", "--val-samples", "0", "--warmup-steps", "1",
                                 "--speed-seconds", "0.1", "--seed", "5"])
    artifacts = tmp_path / "results" / "gpu-proof-test"
    artifacts.mkdir(parents=True)
    result = gpu_proof.measure_speed("32", 2, 1, args, artifacts, clock, label="compiled-32", timeout=300,
                                     options=("--device", "cpu", "--threads", "1", "--compile"))
    assert result["error"].startswith("failed: ") and result["error"].endswith("(see compiled-32.log)")
    assert "\n" not in result["error"] and "no-such-compiler" in result["error"], result["error"]
    log = (artifacts / "compiled-32.log").read_text()
    assert "Traceback" in log and "--compile" in log.splitlines()[0]  # the whole story stays in the log
    assert json.loads(log.strip().splitlines()[-1])["compile"] is True
    figures = gpu_control.compile_figures(result, dict(batch_size=2, train_samples_per_s=10.0))
    assert figures["ratio_to_eager"] is None and figures["ratio_target_met"] is None


def test_speed_measurement_with_ddp_over_two_processes():
    result = _speed("--devices", "2", "--num-workers", "1")
    assert result["strategy"] == "ddp" and result["devices"] == 2
    # Both ranks step together: samples count both, each rank reports its memory.
    assert result["train_samples"] == 2 * 2 * result["steps"]
    assert len(result["peak_memory_bytes"]) == 2 and len(result["device_names"]) == 2
    assert result["val_samples"] == 4  # 3 samples split over 2 ranks: DistributedSampler pads to 2 each


def test_two_plain_processes_time_their_windows_together_and_their_page(tmp_path, monkeypatch):
    """The control for real on CPUs, small: both gpu_speed processes wait for each other after warm-up and start
    timing at the same moment; their samples/s add up and are held against the single process's."""
    artifacts = tmp_path / "results" / "gpu-proof-test"
    ready_dirs: list[Path] = []

    def ready_dir(prefix: str) -> str:  # tempfile.mkdtemp's folder, where this test can find it
        ready_dirs.append(tmp_path / f"{prefix}ready")
        ready_dirs[-1].mkdir()
        return str(ready_dirs[-1])

    monkeypatch.setattr(gpu_control.tempfile, "mkdtemp", ready_dir)
    single = dict(batch_size=2, train_samples_per_s=2.0)
    control = gpu_control.measure_control(2, 1.0, artifacts, gpu_proof.Clock(), single, train_samples=6, seed=5,
                                          warmup_steps=1, options=("--device", "cpu", "--precision", "32",
                                                                   "--threads", "1", "--num-workers", "0"))
    assert "error" not in control, control
    runs = control["runs"]
    assert [run["seed"] for run in runs] == [5, 6] and all(run["ready_count"] == 2 for run in runs)
    assert not any(run["ready_timed_out"] for run in runs) and all(run["val_samples"] == 0 for run in runs)
    # Both slept until the common start: their windows start within a fraction of a step of each other.
    starts = [run["window_start_time"] for run in runs]
    assert max(starts) - min(starts) < 0.25, starts
    assert control["overlap_s"] > 0 and control["overlapped"] == (control["overlap_share"] >= 0.9)
    assert control["samples_per_s"] == pytest.approx(sum(run["train_samples_per_s"] for run in runs), abs=0.1)
    assert control["ratio_to_single"] == pytest.approx(control["samples_per_s"] / 2.0)
    assert control["logs"] == ["control-bf16-mixed-0.log", "control-bf16-mixed-1.log"]
    for n, log in enumerate(control["logs"]):
        first = (artifacts / log).read_text().splitlines()[0]
        assert "--ready-count 2" in first and f"--seed {5 + n}" in first and "--val-samples 0" in first
    assert len(ready_dirs) == 1 and not ready_dirs[0].exists()  # the processes' ready files are gone with it

    proof = json.loads(EXAMPLE_RESULT.read_text())
    proof["control"] = json.loads(json.dumps(control))
    text = render_gpu_page(proof, tmp_path / "logbook", tmp_path / "results").read_text()
    assert f"**{control['samples_per_s']:,.0f} training samples/s together," in text
    assert f"| 1 | 6 | {runs[1]['train_samples_per_s']:,.0f} |" in text


def test_a_control_whose_windows_did_not_overlap_is_flagged_on_its_page(tmp_path):
    def run(start: float, end: float) -> dict:
        return dict(train_samples_per_s=4000.0, window_start_time=start, window_end_time=end)

    together = gpu_control.control_figures([run(100.0, 108.2), run(100.01, 108.1)], dict(train_samples_per_s=8000.0))
    assert together["overlapped"] and together["overlap_s"] == pytest.approx(8.09)
    assert together["samples_per_s"] == 8000.0 and together["ratio_to_single"] == 1.0
    apart = gpu_control.control_figures([run(100.0, 108.0), run(105.0, 113.0)], None)
    assert not apart["overlapped"] and apart["overlap_share"] == pytest.approx(3 / 8)
    assert apart["ratio_to_single"] is None  # the single process failed or did not run
    assert gpu_control.control_figures([run(100.0, 108.0), run(110.0, 118.0)], None)["overlap_s"] == 0

    proof = json.loads(EXAMPLE_RESULT.read_text())
    proof["control"].update(apart)
    text = render_gpu_page(proof, tmp_path, EXAMPLE_RESULT.parent).read_text()
    assert "**Their timed windows did not overlap enough** (38% of the longer, under 90%)" in text
    assert "(no ratio: the single process was not measured)" in text


def test_the_control_stops_the_other_process_when_one_fails(tmp_path):
    logs = [tmp_path / "waits.log", tmp_path / "fails.log"]
    started = time.monotonic()
    codes = gpu_control.run_together([[sys.executable, "-c", "import time; time.sleep(120)"],
                                      [sys.executable, "-c", "raise SystemExit(5)"]], logs, timeout=60)
    assert codes == [None, 5] and time.monotonic() - started < 30
    assert logs[0].read_text().startswith("$ ") and "SystemExit(5)" in logs[1].read_text().splitlines()[0]
    stopped = gpu_control.read_result(logs[0], None, 1024, "the other process failed")
    assert stopped == dict(error="stopped: the other process failed (see waits.log)", log="waits.log")
    assert gpu_control.read_result(logs[1], 5, 1024, "")["error"] == "exit code 5 (see fails.log)"
