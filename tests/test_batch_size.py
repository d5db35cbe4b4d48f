"""A peer's --batch-size auto: the choice of precision, batch and accumulation on fake devices with fake memory (a T4,
an H100, a card too small for the run's batch, a CPU). The real search against a budget on this CPU is
tests/test_baselines.py's batch-finder test (a peer's search through real trials took 75 s here: too slow to add)."""

from __future__ import annotations

import pytest

from hivetrain.batch_size import BatchSearchError, DeviceInfo, Trial, choose_peer_batch
from hivetrain.model import choose_precision

GiB = 2**30
T4 = DeviceInfo("cuda", "Tesla T4", 15 * GiB, (7, 5), bf16=False)
H100 = DeviceInfo("cuda", "NVIDIA H100 80GB HBM3", int(79.1 * GiB), (9, 0), bf16=True)
CPU = DeviceInfo("cpu", "a CPU", 24 * GiB)


def memory_model(device: DeviceInfo, per_sample: dict[str, int], fixed: int = 2 * GiB, tried: list | None = None):
    """A trial function: a batch needs `fixed` bytes plus per_sample[precision] per sample, and fits in the budget
    (within the device's memory). `tried` collects (batch, precision) of every trial."""
    def try_batch(size: int, precision: str, budget: int) -> Trial:
        if tried is not None:
            tried.append((size, precision))
        peak = fixed + size * per_sample[precision]
        if peak > device.total_memory:
            return Trial(size, False, None, 0.0, "CUDA out of memory")
        return Trial(size, peak <= budget, peak, 0.0, "" if peak <= budget else "peak over budget")
    return try_batch


# ViT-B/32-like: bf16 and fp16 activations take about half the memory of fp32 ones.
VIT = {"32": 40 * 2**20, "bf16-mixed": 20 * 2**20, "16-mixed": 20 * 2**20}


def test_a_t4_trains_in_fp16_at_the_largest_batch_that_fits():
    tried = []
    choice = choose_peer_batch(T4, run_batch=64, target_batch=4096, requested_batch=None, precision="auto",
                               try_batch=memory_model(T4, VIT, tried=tried), log=lambda _: None)
    assert choice.precision == "16-mixed"  # no native bf16 below compute capability 8.0
    assert {p for _, p in tried} == {"16-mixed"}
    largest = (int(0.9 * T4.total_memory) - 2 * GiB) // VIT["16-mixed"]  # 588: 90% of the card, by default
    assert largest * 7 / 8 <= choice.micro_batch <= largest and choice.accumulate == 1
    assert choice.per_step == choice.micro_batch
    assert choice.describe() == (f"{choice.micro_batch} per step (auto: largest that fits in 13.5 GiB (90% of"
                                 f" 15.0 GiB) at 16-mixed on Tesla T4)")
    assert len(tried) <= 12  # doubling then bisecting to 1/8: a handful of trials, not a scan


def test_an_h100_trains_in_bf16_up_to_the_swarm_target_batch():
    tried = []
    choice = choose_peer_batch(H100, run_batch=64, target_batch=1024, requested_batch=None, precision="auto",
                               try_batch=memory_model(H100, VIT, tried=tried), log=lambda _: None)
    assert choice.precision == "bf16-mixed"
    assert (choice.micro_batch, choice.accumulate) == (1024, 1)  # 1024 fits in 79 GiB: the target batch caps it
    assert tried == [(1024, "bf16-mixed")]  # the cap first: one trial settles it
    assert choice.reason == ("auto: the swarm's target batch, which fits in 71.2 GiB (90% of 79.1 GiB) at bf16-mixed"
                             " on NVIDIA H100 80GB HBM3")


def test_a_precision_fixed_by_the_run_or_the_user_is_kept():
    fp32 = choose_peer_batch(H100, 64, 4096, None, "32", memory_model(H100, VIT), log=lambda _: None)
    assert fp32.precision == "32"
    assert choose_peer_batch(T4, 64, 4096, None, "bf16-mixed", memory_model(T4, VIT), log=lambda _: None
                             ).precision == "bf16-mixed"


def test_a_card_too_small_for_the_run_batch_accumulates_to_it():
    small = DeviceInfo("cuda", "a small card", 6 * GiB, (7, 5), bf16=False)
    lines = []
    choice = choose_peer_batch(small, run_batch=256, target_batch=1024, requested_batch="auto", precision="auto",
                               try_batch=memory_model(small, VIT), budget_bytes=4 * GiB, log=lines.append)
    found = choice.search.batch_size  # (4 GiB budget - 2 GiB) / 20 MiB: 102 at most
    assert found < 256 and choice.micro_batch <= found
    assert choice.accumulate == -(-256 // found)  # ceil(run batch / found)
    assert 256 <= choice.per_step < 256 + choice.accumulate  # the run's batch, rounded up by < 1 per micro-batch
    assert choice.describe().startswith(f"{choice.per_step} per step as {choice.accumulate} x {choice.micro_batch}"
                                        f" accumulated (auto: {found} fits in 4.0 GiB")
    assert lines[0].startswith("Finding the largest batch") and sum("batch finder:" in line for line in lines) == len(
        choice.search.trials)  # one line per trial
    event = choice.to_event()
    assert (event["batch_size"], event["micro_batch"], event["accumulate"]) == (choice.per_step, choice.micro_batch,
                                                                             choice.accumulate)
    assert len(event["trials"]) == len(choice.search.trials)


def test_a_cpu_keeps_the_run_batch_without_a_search():
    def no_trials(size, precision, budget):
        raise AssertionError("a CPU peer without --batch-size must not search")

    choice = choose_peer_batch(CPU, 32, 256, None, "auto", no_trials, log=lambda _: None)
    assert (choice.per_step, choice.accumulate, choice.precision, choice.search) == (32, 1, "32", None)
    assert choice.describe() == "32 per step (the run's)"


def test_an_explicit_batch_is_kept_on_any_device():
    def no_trials(size, precision, budget):
        raise AssertionError("an explicit --batch-size must not search")

    for device in (T4, H100, CPU):
        choice = choose_peer_batch(device, 32, 256, 48, "auto", no_trials, log=lambda _: None)
        assert (choice.micro_batch, choice.accumulate, choice.search) == (48, 1, None)


def test_auto_on_a_cpu_needs_a_budget():
    with pytest.raises(BatchSearchError, match="--memory-budget"):
        choose_peer_batch(CPU, 32, 256, "auto", "auto", memory_model(CPU, VIT), log=lambda _: None)


def test_a_failed_default_search_falls_back_to_the_run_batch_but_an_asked_one_fails():
    def crashes(size, precision, budget):
        raise BatchSearchError("the batch 64 trial failed (exit 1): boom")

    lines = []
    choice = choose_peer_batch(T4, 64, 256, None, "auto", crashes, log=lines.append)
    assert (choice.per_step, choice.accumulate) == (64, 1) and "search failed" in choice.reason
    assert sum(line.startswith("warning:") for line in lines) == 1
    with pytest.raises(BatchSearchError, match="boom"):
        choose_peer_batch(T4, 64, 256, "auto", "auto", crashes, log=lambda _: None)


def test_choose_precision_takes_the_card_bf16_support():
    assert choose_precision("auto", "cuda", bf16=True) == "bf16-mixed"
    assert choose_precision("auto", "cuda", bf16=False) == "16-mixed"
    assert choose_precision("auto", "cuda", fp16=False, bf16=False) == "32"
    assert choose_precision("auto", "cpu", bf16=True) == "32"



def test_this_cpu_is_described_for_the_choice():
    cpu = DeviceInfo.detect("cpu")
    assert cpu.kind == "cpu" and cpu.total_memory > 2**30 and cpu.name and cpu.compute_capability is None
