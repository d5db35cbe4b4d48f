"""The GPU proof's pieces that run without a GPU: the one-line exit where there is no CUDA, the synthetic data, the
batch finder's trial on generated data, the speed measurement (on CPUs, one process and DDP over gloo), the ceiling run
and its parsing (on a CPU), a swarm variant's figures from its peers' events (the swarm's processes faked), and the
page rendered from an example record and from a record of those pieces. Everything is written under tmp_path."""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_proof, gpu_swarm
from benchmarks.gpu_page import render_gpu_page
from hivetrain.pixels import to_model_input
from hivetrain.synthetic_data import DATA_ORIGIN, SyntheticCifar10

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_RECORD = ROOT / "tests" / "fixtures" / "gpu-proof-example.json"


def run_module(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


def test_without_cuda_it_says_so_in_one_line_and_exits_0(tmp_path):
    out, records = tmp_path / "out", tmp_path / "records"
    done = run_module("benchmarks.gpu_proof", "--out", str(out), "--records", str(records),
                      env={"CUDA_VISIBLE_DEVICES": ""})  # hides any GPU of the machine running the tests
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [gpu_proof.NO_CUDA_LINE]
    assert "Traceback" not in done.stderr
    assert not out.exists() and not records.exists()


@pytest.mark.parametrize("args, message", [
    (["--search-tolerance", "0"], "--search-tolerance must be more than 0"),
    (["--train-samples", "0"], "--train-samples must be at least 1"),
    (["--precisions", "32", "32"], "lists a precision twice"),
    (["--swarm-batch", "0"], "--swarm-batch and --swarm-inner-steps must be at least 1"),
])
def test_bad_input_fails_with_one_line(args, message):
    done = run_module("benchmarks.gpu_proof", *args)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], done.stderr
    assert "Traceback" not in done.stderr


def test_help_explains_what_is_measured():
    done = run_module("benchmarks.gpu_proof", "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    for words in ("synthetic data shaped like CIFAR-10", "batch finder", "DDP", "2-peer swarm", "nvidia-smi",
                  "logbook/gpu.md", "prepare-gpu-wheelhouse.sh", "pure-compute ceiling", "overlapped and blocking",
                  "--no-search", "--swarm-batch", "--swarm-inner-steps"):
        assert words in text, words


def test_synthetic_samples_are_cifar_shaped_and_depend_only_on_seed_split_and_index():
    train = SyntheticCifar10(50_000, seed=7)
    assert len(train) == 50_000 and len(SyntheticCifar10(123, seed=7, split="val")) == 123
    image, label = train[49_999]
    assert image.shape == (3, 32, 32) and image.dtype == torch.uint8
    assert label.dtype == torch.int64 and 0 <= int(label) < 10
    again = SyntheticCifar10(10, seed=7)[3]  # another set of another size: sample 3 is the same image
    assert torch.equal(again[0], train[3][0]) and int(again[1]) == int(train[3][1])
    assert not torch.equal(SyntheticCifar10(10, seed=8)[3][0], train[3][0])
    assert not torch.equal(SyntheticCifar10(10, seed=7, split="val")[3][0], train[3][0])
    assert not torch.equal(train[4][0], train[3][0])
    labels = {int(train[i][1]) for i in range(200)}
    assert labels == set(range(10))
    pixels = torch.stack([train[i][0] for i in range(20)])
    assert int(pixels.min()) == 0 and int(pixels.max()) == 255
    # Made on demand: the 50,000-image set holds no images.
    assert len(pickle.dumps(train)) < 1000
    with pytest.raises(IndexError):
        train[50_000]
    with pytest.raises(ValueError, match="at least 1 sample"):
        SyntheticCifar10(0, seed=0)
    with pytest.raises(ValueError, match="split 'test'"):
        SyntheticCifar10(10, seed=0, split="test")


def test_dataloader_workers_make_the_same_batches_as_direct_reads():
    from torch.utils.data import DataLoader

    data = SyntheticCifar10(12, seed=3)
    images, labels = next(iter(DataLoader(data, batch_size=12, num_workers=2)))
    assert torch.equal(images, torch.stack([data[i][0] for i in range(12)]))
    assert torch.equal(labels, torch.stack([data[i][1] for i in range(12)]))


def test_model_input_is_resized_and_normalised_with_cifar_statistics():
    from hivetrain.pixels import DATASET_STATS

    mean, _ = DATASET_STATS["cifar10"]
    at_mean = torch.stack([torch.full((32, 32), round(255 * m), dtype=torch.uint8) for m in mean]).expand(2, 3, 32, 32)
    x = to_model_input(at_mean, "cifar10", 224)
    assert x.shape == (2, 3, 224, 224) and x.dtype == torch.float32
    assert float(x.abs().max()) < 0.01  # the mean image normalises to 0 (up to rounding to a uint8)
    white = to_model_input(torch.full((1, 3, 32, 32), 255, dtype=torch.uint8), "cifar10", 224)
    assert float(white.min()) > 1.9  # (1 - 0.49) / 0.26 and the like


def test_batch_finder_trial_on_generated_data_needs_no_dataset(tmp_path):
    from hivetrain.batch_size import TrialSpec, run_trial
    from hivetrain.config import get_preset

    # cifar10-vit-b32's dataset is not on this machine (and cannot be downloaded): the trial must not look for it.
    spec = TrialSpec(get_preset("cifar10-vit-b32"), "cpu", "32", threads=1, data_dir=str(tmp_path / "no-data"), steps=1,
                     load_dataset=False)
    trial = run_trial(spec, 2, budget_bytes=None)
    assert trial.fits and trial.peak_bytes > 0
    assert not (tmp_path / "no-data").exists()


def _speed(*args: str) -> dict:
    done = run_module("benchmarks.gpu_speed", "--device", "cpu", "--precision", "32", "--batch-size", "2",
                      "--train-samples", "6", "--val-samples", "3", "--warmup-steps", "1", "--seconds", "0",
                      "--threads", "1", "--seed", "5", *args, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
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


def test_speed_measurement_with_ddp_over_two_processes():
    result = _speed("--devices", "2", "--num-workers", "1")
    assert result["strategy"] == "ddp" and result["devices"] == 2
    # Both ranks step together: samples count both, each rank reports its memory.
    assert result["train_samples"] == 2 * 2 * result["steps"]
    assert len(result["peak_memory_bytes"]) == 2 and len(result["device_names"]) == 2
    assert result["val_samples"] == 4  # 3 samples split over 2 ranks: DistributedSampler pads to 2 each


def test_page_rendered_from_the_example_record(tmp_path):
    record = json.loads(EXAMPLE_RECORD.read_text())
    page = render_gpu_page(record, tmp_path / "logbook", EXAMPLE_RECORD.parent)
    assert page == tmp_path / "logbook" / "gpu.md"
    text = page.read_text()
    assert "**Example record, not a measurement.**" in text  # a fixture must never pass for a measurement
    assert DATA_ORIGIN in text
    assert "NVIDIA H100 80GB HBM3" in text and record["environment"]["commit"] in text
    assert "torch 2.11.0+cu128 (CUDA 12.8" in text
    assert "| `32` | 1792 | 51.70 GiB | 7 |" in text and "1920 did not fit" in text
    assert "the finder's cap (4096)" in text
    assert "| `bf16-mixed` | single (1 GPU) | 4096 | 9,100 | 27,000 | 68.60 GiB |" in text
    assert "out of memory at 1792: smaller batch" in text  # the 32 run stepped down from the found batch
    assert "failed: the batch 4096 trial failed" in text and "not measured: the batch search gave no answer" in text
    assert "DDP: not run, this machine has 1 CUDA GPU" in text
    assert "| sync | 212 | 52.3 s | 14 | 61%, 63% | 0 |" in text
    assert "swarm-sync.nvidia-smi-q.txt" in text and "speed-32-single.nvidia-smi.csv" in text
    for plot in ("gpu-speed.png", "gpu-utilisation.png"):
        assert f"]({plot})" in text
        assert (tmp_path / "logbook" / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (tmp_path / "logbook").iterdir()) == ["gpu-speed.png", "gpu-utilisation.png",
                                                                          "gpu.md"]


def test_page_says_why_the_swarm_did_not_run(tmp_path):
    record = json.loads(EXAMPLE_RECORD.read_text())
    record["swarm"].update(modes=[], skipped="--no-swarm was given")
    text = render_gpu_page(record, tmp_path, EXAMPLE_RECORD.parent).read_text()
    assert "Not run: --no-swarm was given" in text


def test_page_command_refuses_a_record_that_is_not_one(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"kind": "gpu-proof"}))
    done = run_module("benchmarks.gpu_page", str(broken), "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: {broken}: not a GPU proof record (missing or mistyped field 'artifacts')"]


def test_swarm_without_hivemind_or_wheels_says_what_to_do(tmp_path, monkeypatch):
    real_find_spec = gpu_proof.importlib.util.find_spec
    monkeypatch.setattr(gpu_proof.importlib.util, "find_spec",
                        lambda name, *a: None if name == "hivemind" else real_find_spec(name, *a))
    reason = gpu_proof.ensure_hivemind(tmp_path / "empty-wheelhouse", tmp_path / "site", say=lambda _: None)
    assert "hivemind is not installed" in reason and "prepare-gpu-wheelhouse.sh" in reason


def test_unknown_swarm_variants_are_refused_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match="'sync' is not one of diloco-overlapped, diloco-blocking"):
        gpu_swarm.measure_swarm_variants(["diloco-blocking", "sync"], 1.0, 1024, 100, tmp_path, gpu_proof.Clock())
    assert list(tmp_path.iterdir()) == []


def test_a_spent_budget_skips_the_steps_left_and_the_page_of_a_cut_off_proof_says_so(tmp_path):
    clock = gpu_proof.Clock(budget_minutes=0)  # spent from the start: nothing may start
    skipped = clock.spent()
    assert skipped.startswith("skipped:") and "--budget-minutes" in skipped
    assert gpu_proof.Clock(budget_minutes=5).spent() is None
    assert gpu_swarm.measure_swarm_variants(list(gpu_swarm.SWARM_VARIANTS), 1.0, 1024, 100, tmp_path, clock) == [
        dict(variant="diloco-overlapped", error=skipped), dict(variant="diloco-blocking", error=skipped)]
    assert list(tmp_path.iterdir()) == []  # no swarm started

    # What run_proof saves after a step, when the proof is cut off before the rest: finished is still False.
    record = json.loads(EXAMPLE_RECORD.read_text())
    record["finished"] = False
    record["precisions"][-1]["search"] = dict(error=skipped)
    record["precisions"][-1]["single"] = dict(strategy="single", error=skipped)
    record["swarm"] = gpu_proof.new_swarm_record(gpu_proof.parse_args([]), None)
    record["swarm"].update(skipped=None, variants=[dict(variant="diloco-blocking", error=skipped)])
    text = render_gpu_page(record, tmp_path, EXAMPLE_RECORD.parent).read_text()
    assert "**Cut off.**" in text
    assert f"| diloco-blocking | {' | '.join(['–'] * 9)} | {skipped} |" in text
    assert f"– | {skipped} |" in text and f"failed: {skipped}" not in text


def test_sigterm_ends_the_step_running_and_skips_the_rest():
    clock = gpu_proof.Clock()
    previous = gpu_proof.signal.getsignal(gpu_proof.signal.SIGTERM)
    try:
        clock.stop_on_sigterm()
        with pytest.raises(gpu_proof.ProofStopped, match="stopped \\(SIGTERM\\) while this step ran"):
            os.kill(os.getpid(), gpu_proof.signal.SIGTERM)
            time.sleep(5)  # the handler raises in this thread at once; the sleep never ends normally
        assert clock.stopped
        assert clock.spent() == "skipped: the proof was stopped (SIGTERM) before it"
    finally:
        gpu_proof.signal.signal(gpu_proof.signal.SIGTERM, previous)


def test_ceiling_output_must_end_with_its_json_result():
    line = json.dumps(dict(samples_per_s=9000.0, bf16_matmul_flops=7.5e14, train_flops_per_image=26.6e9, mfu=0.32))
    assert gpu_swarm.parse_ceiling_output(f"a warning\n{line}\n")["mfu"] == 0.32
    for text in ("", "Traceback ...\nRuntimeError: CUDA error", json.dumps(dict(samples_per_s=1.0))):
        with pytest.raises(ValueError, match="did not end with its JSON result"):
            gpu_swarm.parse_ceiling_output(text)


class FakeRole:
    """What benchmarks.harness.swarm_window reads of a role that ran: its events and its CPU samples."""

    def __init__(self, events: list[dict]):
        self._events = events

    def events(self, name: str) -> list[dict]:
        return [event for event in self._events if event["event"] == name]

    def event(self, name: str) -> dict:
        return self.events(name)[0]

    def cpu_between(self, start: float, end: float) -> tuple[float, float]:
        return 1.0, 0.5


def _fake_peer(now: float, lag: float, wait_seconds: float) -> FakeRole:
    # a round of 100 inner steps at batch 1024 every 30 s: 3,413 samples/s
    epochs = [dict(event="epoch", time=now - 95 + lag + 30 * n, epoch=n + 1, samples=102_400 * n) for n in range(4)]
    left = dict(event="left", time=now, train_seconds=100.0, swarm_seconds=8.0, wait_seconds=wait_seconds,
                communication_seconds=20.0, missed_rounds=0)
    return FakeRole([dict(event="training_started", time=now - 100 + lag), *epochs, left])


def test_a_swarm_variant_held_against_the_single_process_and_the_ceiling_and_its_page(tmp_path, monkeypatch):
    import benchmarks.gpu_monitor
    import benchmarks.harness

    artifacts = tmp_path / "records" / "gpu-proof-test"
    clock = gpu_proof.Clock()
    clock.zero -= 1000  # the proof started 1000 s ago: the swarm's window (its last 98 s) lies after 900 s

    # The ceiling, run for real on this CPU, small: the same command and parsing as on the GPU.
    ceiling = gpu_swarm.measure_ceiling(2, 0.1, artifacts, clock, options=(
        "--device", "cpu", "--precision", "32", "--img-size", "32", "--matmul-size", "64", "--warmup-steps", "0"))
    assert "error" not in ceiling, (artifacts / "ceiling-bf16-mixed.log").read_text()
    assert ceiling["batch_size"] == 2 and ceiling["train_flops_per_image"] > 0 and ceiling["bf16_matmul_flops"] > 0
    assert "--batch-size 2 --precision bf16-mixed" in (artifacts / ceiling["log"]).read_text().splitlines()[0]

    # The swarm's processes are faked; swarm_window, the shares, the NVML mean and the figures are the proof's own.
    started_swarms = []

    def fake_run_swarm(work, name, peers, coordinator_options, peer_options, timeout, preset):
        started_swarms.append((peers, coordinator_options, peer_options, preset))
        for role in ("coordinator", "peer-0", "peer-1"):
            (work / f"{name}-{role}.log").write_text("a role's log\n")
        now = time.time()
        return FakeRole([]), [_fake_peer(now, 0, wait_seconds=2.0), _fake_peer(now, 2, wait_seconds=5.0)]

    class FakeNvmlSeries:  # GPU utilisation 95% while the peers trained (the last 98 s), idle before and after
        def __init__(self, zero):
            self.zero, self.error = zero, None

        def start(self):
            pass

        def stop(self):
            now = time.monotonic() - self.zero
            return [dict(time_s=now + t, gpu=0, util_percent=u, memory_used_bytes=2**34)
                    for t, u in ((-150, 0.0), (-80, 94.0), (-50, 96.0), (-20, 95.0), (100, 0.0))]

    monkeypatch.setattr(benchmarks.harness, "run_swarm", fake_run_swarm)
    monkeypatch.setattr(benchmarks.gpu_monitor, "NvmlSeries", FakeNvmlSeries)
    record = json.loads(EXAMPLE_RECORD.read_text())
    single = dict(record["precisions"][1]["single"], batch_size=1024, train_samples_per_s=7200.0)
    [run] = gpu_swarm.measure_swarm_variants(["diloco-overlapped"], 1.25, 1024, 100, artifacts, clock,
                                             single=single, ceiling=ceiling)

    assert started_swarms == [(2, ["--mode", "diloco", "--overlap-rounds", "--inner-steps", "100"], [
        "--device", "cuda", "--max-time", "1.25", "--threads", gpu_swarm.peer_args(1, 1)[5], "--batch-size", "1024",
        "--precision", "bf16-mixed"], "synthetic-vit-b32")]
    assert "error" not in run, run
    rate = 2 * 102_400 / 30  # both peers, each a round of 102,400 samples every 30 s
    assert run["samples_per_s"] == pytest.approx(rate)
    assert run["ratio_to_single"] == pytest.approx(rate / 7200) and 0.90 < run["ratio_to_single"] < 0.96
    assert run["ratio_target_met"] is True and run["ratio_stretch_met"] is False
    assert run["mfu"] == pytest.approx(rate * ceiling["train_flops_per_image"] / ceiling["bf16_matmul_flops"])
    assert run["gpu_util_over"] == "window" and run["gpu_util_percent"] == pytest.approx(95.0)
    assert run["swarm_time_share"] == [0.08, 0.08] and run["wait_share"] == [0.02, 0.05]
    assert run["communication_share"] == [0.2, 0.2]
    assert run["logs"] == [f"swarm-diloco-overlapped-{r}.log" for r in ("coordinator", "peer-0", "peer-1")]
    assert all((artifacts / name).exists() for name in run["logs"])

    # A variant whose single-process reference failed still has its samples/s, and no ratio.
    assert gpu_swarm.swarm_figures(rate, dict(error="failed: exit code 1"), ceiling)["ratio_to_single"] is None

    # The page of a short proof (--no-search) with these pieces in the record, as run_proof saves it.
    args = gpu_proof.parse_args(["--no-search", "--precisions", "bf16-mixed", "--swarm-minutes", "1.25"])
    record["settings"].update(search=False, swarm_batch=1024)
    record["reference"] = dict(batch_size=1024, precision="bf16-mixed", single=single,
                               single_from=gpu_swarm.OWN_REFERENCE_RUN, ceiling=ceiling)
    record["swarm"] = gpu_proof.new_swarm_record(args, None)
    record["swarm"].update(skipped=None, variants=json.loads(json.dumps([run, dict(
        variant="diloco-blocking", error="a peer of swarm-diloco-blocking failed (exit code 1); see its log")])))
    text = render_gpu_page(record, tmp_path / "logbook", tmp_path / "records").read_text()
    assert "Not searched (`--no-search`): every precision ran at the swarm's batch, 1024." in text
    assert "## One process at the swarm's batch (1024, `bf16-mixed`)" in text
    assert "**7,200 training samples/s**" in text and "(7,200 samples/s, above)" in text
    assert f"**{ceiling['samples_per_s']:,.0f} samples/s**, MFU **{100 * ceiling['mfu']:.1f}%**" in text
    assert (f"| diloco-overlapped | {rate:,.0f} | {rate / 7200:.3f} | met | not met | 95% | 8.0%, 8.0% |"
            f" 2.0%, 5.0% | {100 * run['mfu']:.1f}% |") in text
    assert "| diloco-blocking | – |" in text and "failed: a peer of swarm-diloco-blocking failed" in text
    assert "--mode diloco --no-overlap-rounds --inner-steps 100" in text
    assert "--batch-size 1024 --precision bf16-mixed" in text
    assert "| ceiling `bf16-mixed` |" in text and "| swarm diloco-overlapped |" in text


def test_a_short_proof_reuses_its_speed_run_as_the_swarms_reference(tmp_path, monkeypatch):
    """run_proof's wiring with --no-search, its runs faked: the bf16-mixed speed run at --swarm-batch is the single
    process the swarm is held against, the ceiling runs at that batch, and both variants get both references."""
    example = json.loads(EXAMPLE_RECORD.read_text())
    calls = []

    def fake_speed(precision, batch, devices, args, artifacts, clock, label=None):
        calls.append(("speed", precision, batch, label))
        return dict(example["precisions"][1]["single"], batch_size=batch, train_samples_per_s=7000.0)

    def fake_ceiling(batch, seconds, artifacts, clock):
        calls.append(("ceiling", batch, seconds))
        return dict(samples_per_s=8000.0, bf16_matmul_flops=8e14, train_flops_per_image=26e9, mfu=0.26,
                    matmul_size=8192, log="ceiling-bf16-mixed.log")

    def fake_swarm(variants, minutes, batch, inner_steps, artifacts, clock, single=None, ceiling=None):
        calls.append(("swarm", tuple(variants), minutes, batch, inner_steps, single["train_samples_per_s"],
                      ceiling["mfu"]))
        return [dict(variant=variant, error="not run: faked") for variant in variants]

    monkeypatch.setattr(gpu_proof, "measure_speed", fake_speed)
    monkeypatch.setattr(gpu_proof, "measure_ceiling", fake_ceiling)
    monkeypatch.setattr(gpu_proof, "measure_swarm_variants", fake_swarm)
    monkeypatch.setattr(gpu_proof, "ensure_hivemind", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = gpu_proof.parse_args(["--precisions", "bf16-mixed", "--no-search", "--speed-seconds", "6",
                                 "--swarm-minutes", "1.25", "--out", str(tmp_path / "out"), "--records",
                                 str(tmp_path / "records"), "--commit", "abc"])
    assert gpu_proof.run_proof(args, "python -m benchmarks.gpu_proof ...") == 0
    assert calls == [("speed", "bf16-mixed", 1024, None), ("ceiling", 1024, 6.0),
                     ("swarm", ("diloco-overlapped",), 1.25, 1024, 100, 7000.0, 0.26),
                     ("swarm", ("diloco-blocking",), 1.25, 1024, 100, 7000.0, 0.26)]
    [path] = (tmp_path / "records").glob("gpu-proof-*.json")
    record = json.loads(path.read_text())
    assert record["finished"] and record["settings"]["search"] is False
    assert record["precisions"][0]["search"] == dict(
        error="skipped: --no-search was given; speed measured at --swarm-batch 1024")
    assert record["reference"]["single_from"] == "the bf16-mixed single-GPU speed run above"
    assert [run["variant"] for run in record["swarm"]["variants"]] == ["diloco-overlapped", "diloco-blocking"]
    text = (tmp_path / "out" / "gpu.md").read_text()
    assert "Not searched (`--no-search`)" in text and "| diloco-blocking | – |" in text
