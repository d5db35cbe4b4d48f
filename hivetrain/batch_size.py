"""Find the largest batch that fits on this machine: `--batch-size auto` of peers/join.py and baselines/run.py.

Each trial is its own process (`python -m hivetrain.batch_size --trial B --config JSON ...`) that loads the run's
dataset (unless told not to: on a GPU, or for runs on generated data), builds its model and optimizer and takes a few
forward + backward + optimizer steps on random images of the run's shape, so its peak memory belongs to that batch
size alone (a process's peak RSS never goes down, and a CUDA context that has hit an OOM is fragmented). A batch fits
on a GPU when no `torch.cuda.OutOfMemoryError` is raised (and, with a budget, when `torch.cuda.max_memory_allocated`
stays within it); on a CPU when the trial's peak RSS stays within the budget. The search doubles from a start size
until a trial fails, then bisects until the gap is within `tolerance` of the size.

What a trial does not hold: Lightning's Trainer, DataLoader batches in flight (and their workers), DDP's gradient
buckets (about one more copy of the gradients) and hivemind's averager. Run results keep the real run's peak memory.

`choose_peer_batch` is a peer's whole decision (precision, search or not, gradient accumulation); it takes the device
as a `DeviceInfo` and the trials as a function, so fake memory budgets test it without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # the search's callers need no torch: RunConfig only types the spec here
    from hivetrain.config import RunConfig

OOM_EXIT = 3  # a trial's exit code for CUDA out of memory
MAX_BATCH = 4096
TOLERANCE = 1 / 8
# A peer's default budget on a GPU, as a share of its memory: the trial does not hold what the peer's training adds
# (hivemind's gradient buffers, DataLoader batches, the CUDA context, the allocator's fragmentation).
GPU_SHARE = 0.9

_UNITS = {"": 1, "b": 1, "k": 1024, "kib": 1024, "m": 1024**2, "mib": 1024**2, "g": 1024**3, "gib": 1024**3,
          "t": 1024**4, "tib": 1024**4, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """'4GiB', '512MiB', '2GB', '1.5G' or a plain number of bytes. Single letters are binary units (as in `free -g`)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size like 4GiB, 512MiB, 2GB or 1073741824")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"{text!r} must be more than 0 bytes")
    return value


def format_bytes(n: int | float) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


class BatchSearchError(RuntimeError):
    """The search cannot give an answer (batch 1 does not fit, or a trial crashed); the message says why."""


@dataclass(frozen=True)
class TrialSpec:
    config: RunConfig  # the run's configuration: its model, optimizer, image size and classes
    device: str  # "cpu" or "cuda"
    precision: str  # "32", "bf16-mixed", "16-mixed", ...
    threads: int | None = None
    data_dir: str | None = None  # the run's --data-dir: a trial holds the same dataset in memory as the run
    steps: int = 3  # optimizer steps per trial: the first allocates Adam's state, the rest show the steady peak
    # False where the dataset costs the measured memory nothing (a GPU: the dataset stays in host memory) or the run
    # trains on generated data (benchmarks/gpu_proof.py, whose preset's dataset may not even be on the machine).
    load_dataset: bool = True


@dataclass
class Trial:
    batch_size: int
    fits: bool
    peak_bytes: int | None  # peak RSS (CPU) or max_memory_allocated (GPU); None when the trial was stopped
    seconds: float
    reason: str  # why it did not fit, or "" when it did


@dataclass
class SearchResult:
    batch_size: int
    budget_bytes: int | None
    cap: int
    trials: list[Trial] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def run_trial(spec: TrialSpec, batch_size: int, budget_bytes: int | None) -> Trial:
    cmd = [sys.executable, "-m", "hivetrain.batch_size", "--trial", str(batch_size), "--config",
           spec.config.to_json(), "--device", spec.device, "--precision", spec.precision, "--steps", str(spec.steps)]
    if spec.threads:
        cmd += ["--threads", str(spec.threads)]
    if spec.data_dir:
        cmd += ["--data-dir", spec.data_dir]
    if not spec.load_dataset:
        cmd.append("--no-dataset")
    import psutil

    # The trial imports hivetrain from where this process did, whatever the working directory (python peers/join.py).
    source_root = str(Path(__file__).resolve().parent.parent)
    python_path = os.pathsep.join(p for p in (source_root, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=python_path, HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"))
    started = time.monotonic()
    # Output goes to files, not pipes: a chatty trial must never block on a full pipe while we poll its memory.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)
        stopped = False
        if spec.device == "cpu" and budget_bytes is not None:
            # Stop a trial as soon as it crosses the budget: a far too large batch must not exhaust the machine.
            child = psutil.Process(proc.pid)
            while proc.poll() is None:
                try:
                    if child.memory_info().rss > budget_bytes:
                        proc.kill()
                        stopped = True
                        break
                except psutil.NoSuchProcess:
                    break
                time.sleep(0.02)
        proc.wait()
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    seconds = time.monotonic() - started
    if stopped:
        return Trial(batch_size, False, None, seconds, "RSS over budget")
    if proc.returncode == OOM_EXIT:
        return Trial(batch_size, False, None, seconds, "CUDA out of memory")
    if proc.returncode != 0:
        tail = " | ".join(stderr.strip().splitlines()[-3:])
        raise BatchSearchError(f"the batch {batch_size} trial failed (exit {proc.returncode}): {tail}")
    result = json.loads(stdout.strip().splitlines()[-1])
    peak = result["peak_cuda"] if spec.device == "cuda" else result["peak_rss"]
    if budget_bytes is not None and peak > budget_bytes:
        return Trial(batch_size, False, peak, seconds, "peak over budget")
    return Trial(batch_size, True, peak, seconds, "")


def find_batch_size(spec: TrialSpec, budget_bytes: int | None, start: int = 32, cap: int = MAX_BATCH,
                    tolerance: float = TOLERANCE, log=print) -> SearchResult:
    """Largest batch of `spec` that fits in `budget_bytes` (required on a CPU; on a GPU, None: its whole memory)."""
    if spec.device == "cpu" and budget_bytes is None:
        raise BatchSearchError("--batch-size auto on a CPU needs --memory-budget (the peak RSS a process may reach)")
    return search_largest(lambda size: run_trial(spec, size, budget_bytes), budget_bytes, start, cap, tolerance, log)


def search_largest(try_batch: Callable[[int], Trial], budget_bytes: int | None, start: int = 32, cap: int = MAX_BATCH,
                   tolerance: float = TOLERANCE, log=print) -> SearchResult:
    """Largest batch that fits, to within `tolerance` of itself: the answer fits and answer * (1 + tolerance) did not
    (so, memory growing with the batch, twice the answer does not fit either), unless the answer is `cap`.

    Args:
        try_batch: runs one trial at a batch size (run_trial, or a fake memory model in tests).
        budget_bytes: only for the progress lines and the result: `try_batch` applies it.
        start: the first size tried; the search doubles from it until a trial fails, then bisects.
        cap: never try or answer more than this (bounds the search's length too).
        tolerance: stop when the gap between fitting and failing sizes is this fraction of the answer.
        log: takes one line per trial.
    """
    result = SearchResult(batch_size=0, budget_bytes=budget_bytes, cap=cap)
    lo, hi = 0, None  # the largest size that fitted, the smallest that did not
    size = max(1, min(start, cap))
    while True:
        trial = try_batch(size)
        result.trials.append(trial)
        budget = f" of {format_bytes(budget_bytes)}" if budget_bytes else ""
        peak = f"peak {format_bytes(trial.peak_bytes)}{budget}" if trial.peak_bytes is not None else "stopped"
        log(f"batch finder: {size:5d} {'fits' if trial.fits else 'does not fit: ' + trial.reason}"
            f" ({peak}, {trial.seconds:.1f} s)")
        if trial.fits:
            lo = size
            if lo >= cap:
                break
        else:
            hi = size
        if hi is None:
            size = min(2 * size, cap)
        elif hi - lo <= max(1, int(lo * tolerance)):
            break
        else:
            size = (lo + hi) // 2
    if lo == 0:
        raise BatchSearchError(f"not even batch 1 fits in {format_bytes(budget_bytes) if budget_bytes else 'memory'}"
                               f" ({result.trials[-1].reason})")
    result.batch_size = lo
    return result


# --- a peer's choice ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceInfo:
    """What a peer's batch choice needs to know about the device it trains on."""

    kind: str  # "cuda" or "cpu"
    name: str  # "NVIDIA H100 80GB HBM3", or the CPU's name
    total_memory: int  # bytes: the GPU's memory, or the machine's RAM
    compute_capability: tuple[int, int] | None = None  # CUDA only, e.g. (7, 5) for a T4
    bf16: bool = False  # computes in bf16 natively (compute capability 8.0 or more)

    @classmethod
    def detect(cls, kind: str) -> DeviceInfo:
        """The current CUDA device for "cuda", the machine's CPU and RAM for "cpu"."""
        import psutil
        import torch

        from hivetrain.model import cuda_has_native_bf16
        from hivetrain.run_result import cpu_name

        if kind != "cuda":
            return cls("cpu", cpu_name(), psutil.virtual_memory().total)
        properties = torch.cuda.get_device_properties(torch.cuda.current_device())
        return cls("cuda", properties.name, properties.total_memory, (properties.major, properties.minor),
                   cuda_has_native_bf16())


@dataclass(frozen=True)
class BatchChoice:
    """A peer's batch: `micro_batch` samples per forward/backward, `accumulate` of them per optimizer step."""

    micro_batch: int
    accumulate: int
    precision: str
    reason: str  # why, for the join line: "the run's", "--batch-size 64", "auto: largest that fits in ..."
    search: SearchResult | None = None  # the trials, when there was a search

    @property
    def per_step(self) -> int:
        """Samples per optimizer step: what the peer adds to the swarm's count each step."""
        return self.micro_batch * self.accumulate

    def describe(self) -> str:
        """The join line's batch part, e.g. "64 per step as 4 x 16 accumulated (auto: 16 fits in 15.0 GiB ...)"."""
        how = "" if self.accumulate == 1 else f" as {self.accumulate} x {self.micro_batch} accumulated"
        return f"{self.per_step} per step{how} ({self.reason})"

    def to_event(self) -> dict:
        trials = None if self.search is None else [dataclasses.asdict(t) for t in self.search.trials]
        return dict(batch_size=self.per_step, micro_batch=self.micro_batch, accumulate=self.accumulate,
                    precision=self.precision, reason=self.reason, trials=trials)


def choose_peer_batch(device: DeviceInfo, run_batch: int, target_batch: int, requested_batch: int | str | None,
                      precision: str, try_batch: Callable[[int, str, int], Trial],
                      budget_bytes: int | None = None, tolerance: float = TOLERANCE, log=print) -> BatchChoice:
    """A peer's batch and precision.

    Without --batch-size a GPU searches (auto; the run's batch when the search fails) and a CPU takes the run's
    batch. auto takes the largest micro-batch that fits at `precision`, trying the cap (the run's target batch, or
    MAX_BATCH) first: at or above the run's per-step batch it is the step's batch; below it, gradients accumulate over
    ceil(run batch / found) micro-batches of ceil(run batch / accumulate) samples, so a step holds the run's batch
    (rounded up by less than one sample per micro-batch).

    Args:
        device: the device the peer trains on (DeviceInfo.detect, or a fake one in tests).
        run_batch: the run's per-step batch (RunConfig.batch_size).
        target_batch: the swarm's target batch: no peer's step should be larger.
        requested_batch: --batch-size as typed: None, "auto" or a number.
        precision: --precision or the run's, "auto" included: choose_precision resolves it for `device`.
        try_batch: runs one trial at (batch, precision, budget in bytes): run_trial, or a fake memory model.
        budget_bytes: the memory a batch may use (--memory-budget); None: GPU_SHARE of the GPU's memory (required for
            auto on a CPU).
        tolerance, log: as for search_largest.
    """
    from hivetrain.model import choose_precision

    precision = choose_precision(precision, device.kind, bf16=device.bf16)
    if requested_batch is None and device.kind != "cuda":
        return BatchChoice(run_batch, 1, precision, "the run's")
    if requested_batch not in (None, "auto"):
        return BatchChoice(int(requested_batch), 1, precision, f"--batch-size {requested_batch}")
    if device.kind == "cpu" and budget_bytes is None:
        raise BatchSearchError("--batch-size auto on a CPU needs --memory-budget (the peak RSS the peer may reach)")
    room = format_bytes(budget_bytes) if budget_bytes is not None else (
        f"{format_bytes(GPU_SHARE * device.total_memory)} ({GPU_SHARE:.0%} of {format_bytes(device.total_memory)})")
    if budget_bytes is None:
        budget_bytes = int(GPU_SHARE * device.total_memory)
    cap = max(1, min(MAX_BATCH, target_batch))
    log(f"Finding the largest batch that fits on {device.name} at {precision} (at most {cap}; one line per trial)")
    try:
        # The cap first: on a large card one trial settles it, and a batch that does not fit fails fast (CUDA out of
        # memory, or the CPU trial stopped at the budget); the bisection below it takes log2 steps as doubling would.
        search = search_largest(lambda size: try_batch(size, precision, budget_bytes), budget_bytes, start=cap, cap=cap,
                                tolerance=tolerance, log=log)
    except BatchSearchError as e:
        if requested_batch == "auto":  # asked for: the peer cannot do what it was told
            raise
        # The default on a GPU: the run's batch still trains (or fails at the first step, saying why).
        log(f"warning: the batch search failed, training at the run's batch: {e}")
        return BatchChoice(run_batch, 1, precision, "the run's: the search failed")
    found = search.batch_size
    where = f"in {room} at {precision} on {device.name}"
    if found == cap:
        limit = "the swarm's target batch" if cap == target_batch else f"the search's cap of {MAX_BATCH}"
        return BatchChoice(found, 1, precision, f"auto: {limit}, which fits {where}", search)
    if found >= run_batch:
        return BatchChoice(found, 1, precision, f"auto: largest that fits {where}", search)
    accumulate = math.ceil(run_batch / found)
    micro = math.ceil(run_batch / accumulate)
    return BatchChoice(micro, accumulate, precision,
                       f"auto: {found} fits {where}, accumulated to the run's {run_batch}", search)


def main(argv: list[str] | None = None) -> int:
    """One trial: a few training steps on random data at one batch; its peak memory as JSON, exit 3 on CUDA OOM."""
    parser = argparse.ArgumentParser(
        prog="python -m hivetrain.batch_size",
        description="One batch-size trial of --batch-size auto: a few training steps of the run's model on random data"
                    " at batch B; prints its peak memory as JSON, exits 3 on CUDA out of memory.",
    )
    parser.add_argument("--trial", type=int, required=True, metavar="B", help="the batch size to try")
    parser.add_argument("--config", required=True, help="the run's configuration as JSON (RunConfig.to_json)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--precision", choices=("32", "bf16-mixed", "16-mixed"), default="32")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--data-dir", default=None, help="where datasets are stored (default: ~/.cache/hivetrain/data)")
    parser.add_argument("--no-dataset", action="store_true", help="do not load the run's dataset")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    code = _trial(parser.parse_args(argv))
    # Straight out: the interpreter's teardown of torch grows RSS by ~100 MB for a moment, which the parent's budget
    # watch would count against this batch size.
    sys.stdout.flush()
    os._exit(code)


def _trial(args: argparse.Namespace) -> int:
    import resource

    import torch
    import torch.nn.functional as F

    from hivetrain.config import RunConfig
    from hivetrain.model import autocast_dtype, create_model
    from hivetrain.optimizer import make_optimizer

    if args.threads:
        torch.set_num_threads(args.threads)
    config = RunConfig.from_json(args.config)
    if not args.no_dataset:  # the run holds its dataset in memory: so does the trial
        from hivetrain.data import make_datamodule

        make_datamodule(config, args.data_dir).setup()
    # Memory does not depend on where the weights come from: skip pretrained weights (no hub, no file needed).
    model = create_model(dataclasses.replace(config.model, pretrained=False), seed=config.seed).to(args.device)
    optimizer, _ = make_optimizer(model, config.optim)
    size, classes = config.model.img_size, config.model.num_classes
    images = torch.randn(args.trial, 3, size, size, device=args.device)
    labels = torch.randint(0, classes, (args.trial,), device=args.device)
    dtype = autocast_dtype(args.precision)
    try:
        for _ in range(args.steps):
            with torch.autocast(args.device, dtype=dtype, enabled=dtype is not None):
                loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if args.device == "cuda":
            torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError:
        return OOM_EXIT
    peak_cuda = torch.cuda.max_memory_allocated() if args.device == "cuda" else None
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    print(json.dumps(dict(batch_size=args.trial, peak_rss=peak_rss, peak_cuda=peak_cuda)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
