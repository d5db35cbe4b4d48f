"""The GPU proof's pieces that run without a GPU: the one-line exit where there is no CUDA, the synthetic data, the
batch finder's trial on generated data, the ceiling run and its parsing (on a CPU), a swarm variant's figures from its
peers' events (the swarm's processes faked), the proof's wiring (its runs faked), and the page rendered from an
example result and from a result of those pieces; the speed runs and the control are in test_gpu_runs.py.
Everything is written under tmp_path."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_control, gpu_proof, gpu_swarm
from benchmarks.gpu_page import render_gpu_page
from hivetrain.pixels import to_model_input
from hivetrain.synthetic_data import DATA_ORIGIN, SyntheticCifar10

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_RESULT = ROOT / "tests" / "fixtures" / "gpu-proof-example.json"


def run_module(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


@pytest.fixture(autouse=True)
def _pythonpath_restored(monkeypatch):
    """gpu_proof.main puts the repository on PYTHONPATH for the processes it starts; run in-process here, that must
    not outlive the test (a later test's subprocess would see this clone's hivetrain on its path)."""
    monkeypatch.delenv("PYTHONPATH", raising=False)


def test_without_cuda_it_says_so_in_one_line_and_exits_0(tmp_path):
    out, results = tmp_path / "out", tmp_path / "results"
    done = run_module("benchmarks.gpu_proof", "--out", str(out), "--results", str(results),
                      env={"CUDA_VISIBLE_DEVICES": ""})  # hides any GPU of the machine running the tests
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [gpu_proof.NO_CUDA_LINE]
    assert "Traceback" not in done.stderr
    assert not out.exists() and not results.exists()


@pytest.mark.parametrize("args, message", [
    (["--search-tolerance", "0"], "--search-tolerance must be more than 0"),
    (["--train-samples", "0"], "--train-samples must be at least 1"),
    (["--precisions", "32", "32"], "lists a precision twice"),
    (["--swarm-batch", "0"], "--swarm-batch and --swarm-inner-steps must be at least 1"),
    (["--swarm-variants", "diloco-blocking", "diloco-blocking"], "--swarm-variants lists a variant twice"),
    (["--swarm-variants", "sync"], "argument --swarm-variants: invalid choice: 'sync'"),
])
def test_bad_input_fails_with_one_line(args, message):
    done = run_module("benchmarks.gpu_proof", *args)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], done.stderr
    assert "Traceback" not in done.stderr


def test_help_explains_what_is_measured():
    done = run_module("benchmarks.gpu_proof", "--help", env={"COLUMNS": "500"})  # argparse wraps at hyphens too
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    for words in ("synthetic data shaped like CIFAR-10", "batch finder", "DDP", "2-peer swarm", "nvidia-smi",
                  "logbook/gpu.md", "prepare-gpu-wheelhouse.sh", "pure-compute ceiling", "overlapped and blocking",
                  "--no-search", "--swarm-batch", "--swarm-inner-steps", "--swarm-variants", "--no-control",
                  "two plain processes", "--no-compile-run", "torch.compile", "target 1.2 times",
                  "diloco-overlapped (2 peer(s), coordinator --mode diloco --overlap-rounds)",
                      "diloco-one-peer (1 peer(s)"):
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


def test_page_rendered_from_the_example_result(tmp_path):
    proof = json.loads(EXAMPLE_RESULT.read_text())
    page = render_gpu_page(proof, tmp_path / "logbook", EXAMPLE_RESULT.parent)
    assert page == tmp_path / "logbook" / "gpu.md"
    text = page.read_text()
    assert "**Example result, not a measurement.**" in text  # a fixture must never pass for a measurement
    assert DATA_ORIGIN in text
    assert "NVIDIA H100 80GB HBM3" in text and proof["environment"]["commit"] in text
    assert "torch 2.11.0+cu128 (CUDA 12.8" in text
    assert "| `32` | 1792 | 51.70 GiB | 7 |" in text and "1920 did not fit" in text
    assert "the finder's cap (4096)" in text
    assert "| `bf16-mixed` | single (1 GPU) | 4096 | 9,100 | 27,000 | 68.60 GiB |" in text
    assert "out of memory at 1792: smaller batch" in text  # the 32 run stepped down from the found batch
    assert "failed: the batch 4096 trial failed" in text and "not measured: the batch search gave no answer" in text
    assert "DDP: not run, this machine has 1 CUDA GPU" in text
    assert "| sync | 212 | 52.3 s | 14 | 61%, 63% | 0 |" in text
    # the example's raw files are not beside it: named, marked as not kept, never linked to a file that is not there
    assert "nvidia-smi-q.txt (not kept)" in text and "swarm-sync-peer-0.log (not kept)" in text
    for plot in ("gpu-speed.png", "gpu-utilisation.png"):
        assert f"]({plot})" in text
        assert (tmp_path / "logbook" / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (tmp_path / "logbook").iterdir()) == ["gpu-speed.png", "gpu-utilisation.png",
                                                                          "gpu.md"]
    # The compiled single process against the eager reference, and the control of two plain processes.
    assert ("With torch.compile (`benchmarks.gpu_speed --compile`, default mode, no validation pass): **10,546 training"
            " samples/s** at batch 1024 (62 steps in 6.0 s), **1.241×** the eager process's 8,500, target ≥ 1.2:"
            " met."
            " Compilation happens in the first of 10 untimed warm-up steps, which took 48.3 s") in text
    assert "## Two plain processes sharing the GPU (the swarm's control)" in text
    assert "**7,410 training samples/s together, 0.872 of one process's** (8,500 samples/s, above)" in text
    assert "| 0 | 0 | 3,700 | 12:04:10.251–12:04:18.552 | 30 in 8.3 s | 1.6 s | 18.61 GiB |" in text
    assert "| both |  | **7,410** | overlap 8.28 s (100% of the longer) |" in text
    assert "did not overlap enough" not in text and "over the windows' overlap: 100%" in text
    assert "| two plain processes (control) | 330–366 s |" in text and "| speed `bf16-mixed` compiled |" in text
    assert text.index("## One process at") < text.index("## Two plain processes") < text.index("## The swarm on the GPU")


def test_page_says_why_the_swarm_did_not_run(tmp_path):
    proof = json.loads(EXAMPLE_RESULT.read_text())
    proof["swarm"].update(modes=[], skipped="--no-swarm was given")
    text = render_gpu_page(proof, tmp_path, EXAMPLE_RESULT.parent).read_text()
    assert "Not run: --no-swarm was given" in text


def test_page_command_refuses_a_result_that_is_not_one(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"kind": "gpu-proof"}))
    done = run_module("benchmarks.gpu_page", str(broken), "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: {broken}: not a GPU proof result (missing or mistyped field 'artifacts')"]


def test_swarm_without_hivemind_or_wheels_says_what_to_do(tmp_path, monkeypatch):
    real_find_spec = gpu_swarm.importlib.util.find_spec
    monkeypatch.setattr(gpu_swarm.importlib.util, "find_spec",
                        lambda name, *a: None if name == "hivemind" else real_find_spec(name, *a))
    reason = gpu_swarm.ensure_hivemind(tmp_path / "empty-wheelhouse", tmp_path / "site", say=lambda _: None)
    assert "hivemind is not installed" in reason and "prepare-gpu-wheelhouse.sh" in reason


def test_unknown_swarm_variants_are_refused_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match="'sync' is not one of diloco-overlapped, diloco-blocking, diloco-paced, diloco-one-peer"):
        gpu_swarm.measure_swarm_variants(["diloco-blocking", "sync"], 1.0, 1024, 100, tmp_path, gpu_proof.Clock())
    assert list(tmp_path.iterdir()) == []


def test_a_spent_budget_skips_the_steps_left_and_the_page_of_a_cut_off_proof_says_so(tmp_path):
    clock = gpu_proof.Clock(budget_minutes=0)  # spent from the start: nothing may start
    skipped = clock.spent()
    assert skipped.startswith("skipped:") and "--budget-minutes" in skipped
    assert gpu_proof.Clock(budget_minutes=5).spent() is None
    assert gpu_swarm.measure_swarm_variants(list(gpu_swarm.SWARM_VARIANTS), 1.0, 1024, 100, tmp_path, clock) == [
        dict(variant=variant, error=skipped) for variant in gpu_swarm.SWARM_VARIANTS]
    # The control and the compiled run skip alike (and say so), as do --no-control and --no-compile-run.
    for flags, control_error, compiled_error in (
            ([], skipped, skipped),
            (["--no-control", "--no-compile-run"], "skipped: --no-control was given",
             "skipped: --no-compile-run was given")):
        skipping: dict = dict(reference=dict(single=dict(train_samples_per_s=8500.0, batch_size=1024)))
        gpu_control.run_control(skipping, gpu_proof.parse_args(flags), tmp_path, clock)
        gpu_proof.measure_compiled(skipping, gpu_proof.parse_args(flags), tmp_path, clock)
        assert skipping["control"] == dict(error=control_error) and skipping["compiled"] == dict(error=compiled_error)
    assert list(tmp_path.iterdir()) == []  # no swarm, control or compiled run started

    # What run_proof saves after a step, when the proof is cut off before the rest: finished is still False.
    proof = json.loads(EXAMPLE_RESULT.read_text())
    proof["finished"] = False
    proof["precisions"][-1]["search"] = dict(error=skipped)
    proof["precisions"][-1]["single"] = dict(strategy="single", error=skipped)
    proof["swarm"] = gpu_swarm.new_swarm_result(["diloco-blocking"], 1.0, 1024, 100, None)
    proof["swarm"].update(skipped=None, variants=[dict(variant="diloco-blocking", error=skipped)])
    proof["control"], proof["compiled"] = dict(error=skipped), None
    text = render_gpu_page(proof, tmp_path, EXAMPLE_RESULT.parent).read_text()
    assert "**Cut off.**" in text
    assert f"| diloco-blocking | 2 | {' | '.join(['–'] * 10)} | {skipped} |" in text
    assert f"– | {skipped} |" in text and f"failed: {skipped}" not in text
    assert f"Not measured: {skipped}." in text
    assert "--compile`, default mode, no validation pass): not reached: the proof stopped before it." in text


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
    import benchmarks.gpu_usage
    import benchmarks.harness

    artifacts = tmp_path / "results" / "gpu-proof-test"
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
        for role in ("coordinator", *(f"peer-{index}" for index in range(peers))):
            (work / f"{name}-{role}.log").write_text("a role's log\n")
        now = time.time()
        return FakeRole([]), [_fake_peer(now, 0, wait_seconds=2.0), _fake_peer(now, 2, wait_seconds=5.0)][:peers]

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
    monkeypatch.setattr(benchmarks.gpu_usage, "NvmlSeries", FakeNvmlSeries)
    proof = json.loads(EXAMPLE_RESULT.read_text())
    single = dict(proof["precisions"][1]["single"], batch_size=1024, train_samples_per_s=7200.0)
    control = dict(proof["control"], samples_per_s=6400.0)
    [run] = gpu_swarm.measure_swarm_variants(["diloco-overlapped"], 1.25, 1024, 100, artifacts, clock,
                                             single=single, ceiling=ceiling, control=control)

    assert started_swarms == [(2, ["--mode", "diloco", "--overlap-rounds", "--inner-steps", "100"], [
        "--device", "cuda", "--max-time", "1.25", "--threads", gpu_swarm.peer_args(1, 1)[5], "--batch-size", "1024",
        "--precision", "bf16-mixed"], "synthetic-vit-b32")]
    assert "error" not in run, run
    rate = 2 * 102_400 / 30  # both peers, each a round of 102,400 samples every 30 s
    assert run["samples_per_s"] == pytest.approx(rate)
    assert run["ratio_to_single"] == pytest.approx(rate / 7200) and 0.90 < run["ratio_to_single"] < 0.96
    assert run["ratio_target_met"] is True and run["ratio_stretch_met"] is False
    assert run["control_samples_per_s"] == 6400.0 and run["ratio_to_control"] == pytest.approx(rate / 6400)
    assert run["mfu"] == pytest.approx(rate * ceiling["train_flops_per_image"] / ceiling["bf16_matmul_flops"])
    assert run["gpu_util_over"] == "window" and run["gpu_util_percent"] == pytest.approx(95.0)
    assert run["swarm_time_share"] == [0.08, 0.08] and run["wait_share"] == [0.02, 0.05]
    assert run["communication_share"] == [0.2, 0.2]
    assert run["logs"] == [f"swarm-diloco-overlapped-{r}.log" for r in ("coordinator", "peer-0", "peer-1")]
    assert all((artifacts / name).exists() for name in run["logs"])

    # One peer alone on the GPU: held against the single process, not against two processes sharing the GPU.
    [alone] = gpu_swarm.measure_swarm_variants(["diloco-one-peer"], 1.25, 1024, 100, artifacts, clock, single=single,
                                               ceiling=ceiling, control=control)
    assert started_swarms[-1][0] == 1 and alone["peers"] == 1 and run["peers"] == 2
    assert alone["samples_per_s"] == pytest.approx(rate / 2) and alone["ratio_to_single"] == pytest.approx(rate / 14400)
    assert alone["ratio_to_control"] is None and alone["swarm_time_share"] == [0.08]

    # A variant whose single-process reference or control failed still has its samples/s, and no ratio.
    failed = gpu_swarm.swarm_figures(rate, dict(error="failed: exit code 1"), ceiling, dict(error="skipped: ..."))
    assert failed["ratio_to_single"] is None and failed["ratio_to_control"] is None

    # The page of a short proof (--no-search) with these pieces in the result, as run_proof saves it.
    args = gpu_proof.parse_args(["--no-search", "--precisions", "bf16-mixed", "--swarm-minutes", "1.25"])
    proof["settings"].update(search=False, swarm_batch=1024)
    proof["reference"] = dict(batch_size=1024, precision="bf16-mixed", single=single,
                               single_from=gpu_swarm.OWN_REFERENCE_RUN, ceiling=ceiling)
    proof["control"] = control
    proof["swarm"] = gpu_swarm.new_swarm_result(args.swarm_variants, args.swarm_minutes, args.swarm_batch,
                                                 args.swarm_inner_steps, None)
    proof["swarm"].update(skipped=None, variants=json.loads(json.dumps([run, dict(
        variant="diloco-blocking", error="a peer of swarm-diloco-blocking failed (exit code 1); see its log")])))
    text = render_gpu_page(proof, tmp_path / "logbook", tmp_path / "results").read_text()
    assert "Not searched (`--no-search`): every precision ran at the swarm's batch, 1024." in text
    assert "## One process at the swarm's batch (1024, `bf16-mixed`)" in text
    assert "**7,200 training samples/s**" in text and "(7,200 samples/s, above)" in text
    assert f"**{ceiling['samples_per_s']:,.0f} samples/s**, MFU **{100 * ceiling['mfu']:.1f}%**" in text
    assert (f"| diloco-overlapped | 2 | {rate:,.0f} | {rate / 7200:.3f} | {rate / 6400:.3f} | met | not met | 95% |"
            f" 8.0%, 8.0% | 2.0%, 5.0% | {100 * run['mfu']:.1f}% |") in text
    assert "| of one process's | of two plain processes' |" in text
    assert "by the control's, two plain processes sharing the GPU (6,400 samples/s, above; two peers only)" in text
    assert "| diloco-blocking | 2 | – |" in text and "failed: a peer of swarm-diloco-blocking failed" in text
    assert "--mode diloco --no-overlap-rounds --inner-steps 100" in text
    assert "--batch-size 1024 --precision bf16-mixed" in text
    assert "| ceiling `bf16-mixed` |" in text and "| swarm diloco-overlapped |" in text


COMPILED_RUN = ("speed", "bf16-mixed", 1024, "compiled-bf16-mixed",
                ("--compile", "--val-samples", "0", "--warmup-steps", str(gpu_control.COMPILE_WARMUP_STEPS)))


@pytest.mark.parametrize("flags, expected_calls", [
    ([], [("speed", "bf16-mixed", 1024, None, ()), ("ceiling", 1024, 6.0), ("control", 1024, 6.0, 7000.0),
          ("swarm", ("diloco-overlapped",), 1.25, 1024, 100, 7000.0, 0.26, 6300.0),
          ("swarm", ("diloco-blocking",), 1.25, 1024, 100, 7000.0, 0.26, 6300.0),
          ("swarm", ("diloco-paced",), 1.25, 1024, 100, 7000.0, 0.26, 6300.0),
          ("swarm", ("diloco-one-peer",), 1.25, 1024, 100, 7000.0, 0.26, 6300.0), COMPILED_RUN]),
    (["--swarm-variants", "diloco-blocking", "--no-control", "--no-compile-run"],
     [("speed", "bf16-mixed", 1024, None, ()), ("ceiling", 1024, 6.0),
      ("swarm", ("diloco-blocking",), 1.25, 1024, 100, 7000.0, 0.26, None)]),
])
def test_a_short_proof_reuses_its_speed_run_as_the_swarms_reference(tmp_path, monkeypatch, flags, expected_calls):
    """run_proof's wiring with --no-search, its runs faked: the bf16-mixed speed run at --swarm-batch is the single
    process the swarm, the control and the compiled run are held against, the ceiling and the control run at that
    batch, every variant of --swarm-variants gets all three references, and the compiled run comes last."""
    example = json.loads(EXAMPLE_RESULT.read_text())
    calls = []

    def fake_speed(precision, batch, devices, args, artifacts, clock, label=None, options=(), timeout=None):
        calls.append(("speed", precision, batch, label, options))
        compiled = "--compile" in options
        assert timeout == (gpu_control.COMPILE_TIMEOUT_S if compiled else None)  # the budget has minutes left
        return dict(example["precisions"][1]["single"], batch_size=batch,
                    train_samples_per_s=9100.0 if compiled else 7000.0, first_step_seconds=40.0, warmup_seconds=41.0)

    def fake_ceiling(batch, seconds, artifacts, clock):
        calls.append(("ceiling", batch, seconds))
        return dict(samples_per_s=8000.0, bf16_matmul_flops=8e14, train_flops_per_image=26e9, mfu=0.26,
                    matmul_size=8192, log="ceiling-bf16-mixed.log")

    def fake_control(batch, seconds, artifacts, clock, single, *, train_samples, seed, warmup_steps):
        calls.append(("control", batch, seconds, single["train_samples_per_s"]))
        return dict(example["control"], samples_per_s=6300.0)

    def fake_swarm(variants, minutes, batch, inner_steps, artifacts, clock, single=None, ceiling=None, control=None):
        calls.append(("swarm", tuple(variants), minutes, batch, inner_steps, single["train_samples_per_s"],
                      ceiling["mfu"], control.get("samples_per_s")))
        return [dict(variant=variant, error="not run: faked") for variant in variants]

    monkeypatch.setattr(gpu_proof, "measure_speed", fake_speed)
    monkeypatch.setattr(gpu_proof, "measure_ceiling", fake_ceiling)
    monkeypatch.setattr(gpu_control, "measure_control", fake_control)
    monkeypatch.setattr(gpu_proof, "measure_swarm_variants", fake_swarm)
    monkeypatch.setattr(gpu_proof, "ensure_hivemind", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = gpu_proof.parse_args(["--precisions", "bf16-mixed", "--no-search", "--speed-seconds", "6",
                                 "--swarm-minutes", "1.25", "--out", str(tmp_path / "out"), "--results",
                                 str(tmp_path / "results"), "--commit", "abc", *flags])
    assert gpu_proof.run_proof(args, "python -m benchmarks.gpu_proof ...") == 0
    assert calls == expected_calls
    [path] = (tmp_path / "results").glob("gpu-proof-*.json")
    proof = json.loads(path.read_text())
    assert proof["finished"] and proof["settings"]["search"] is False
    assert proof["precisions"][0]["search"] == dict(
        error="skipped: --no-search was given; speed measured at --swarm-batch 1024")
    assert proof["reference"]["single_from"] == "the bf16-mixed single-GPU speed run above"
    variants = [call[1][0] for call in expected_calls if call[0] == "swarm"]
    assert [run["variant"] for run in proof["swarm"]["variants"]] == variants
    assert list(proof["swarm"]["coordinator_commands"]) == variants == proof["settings"]["swarm_variants"]
    text = (tmp_path / "out" / "gpu.md").read_text()
    assert "Not searched (`--no-search`)" in text and "| diloco-blocking | 2 | – |" in text
    if flags:
        assert proof["control"] == dict(error="skipped: --no-control was given")
        assert proof["compiled"] == dict(error="skipped: --no-compile-run was given")
        assert "Not measured: skipped: --no-control was given." in text
        assert "--compile`, default mode, no validation pass): skipped: --no-compile-run was given." in text
    else:
        assert proof["control"]["samples_per_s"] == 6300.0
        compiled = proof["compiled"]
        assert compiled["ratio_to_eager"] == pytest.approx(1.3) and compiled["ratio_target_met"] is True
        assert compiled["eager_samples_per_s"] == 7000.0 and compiled["ratio_target"] == 1.2
        assert "**9,100 training samples/s** at batch 1024" in text and "**1.300×** the eager process's 7,000" in text
