"""Find the largest per-device batch that fits: `--batch-size auto` of baselines/run.py.

Each trial is its own process (`python -m baselines.batch_finder --trial B ...`) that loads the run's dataset
(unless the run trains on generated data: `--no-dataset`), builds its model and optimizer and takes a few forward +
backward + optimizer steps on random images of the run's shape, so its peak memory belongs to that batch size alone
(a process's peak RSS never goes down, and a CUDA context that has hit an OOM is fragmented). A batch fits on a GPU
when no `torch.cuda.OutOfMemoryError` is raised (and, with a budget, when `torch.cuda.max_memory_allocated` stays
within it); on a CPU when the trial's peak RSS stays within the budget. The search doubles from a start size until a
trial fails, then bisects until the gap is within `tolerance` of the size.

What a trial does not hold: Lightning's Trainer, DataLoader batches in flight (and their workers), and DDP's gradient
buckets (about one more copy of the gradients). The run record keeps the real run's peak memory per rank, so the
margin is visible.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

OOM_EXIT = 3  # a trial's exit code for CUDA out of memory
MAX_BATCH = 4096

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
    preset: str
    device: str  # "cpu" or "cuda"
    precision: str  # "32", "bf16-mixed", "16-mixed", ...
    threads: int | None = None
    data_dir: str | None = None  # the run's --data-dir: a trial holds the same dataset in memory as the run
    steps: int = 3  # optimizer steps per trial: the first allocates Adam's state, the rest show the steady peak
    # False for runs that train on generated data and hold no dataset (benchmarks/gpu_proof.py): the trial then
    # skips loading the preset's dataset, which may not even be on the machine.
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
    cmd = [sys.executable, "-m", "baselines.batch_finder", "--preset", spec.preset, "--trial", str(batch_size),
           "--device", spec.device, "--precision", spec.precision, "--steps", str(spec.steps)]
    if spec.threads:
        cmd += ["--threads", str(spec.threads)]
    if spec.data_dir:
        cmd += ["--data-dir", spec.data_dir]
    if not spec.load_dataset:
        cmd.append("--no-dataset")
    import psutil

    started = time.monotonic()
    # Output goes to files, not pipes: a chatty trial must never block on a full pipe while we poll its memory.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True,
                                env=dict(os.environ, HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1")))
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
                    tolerance: float = 1 / 8, log=print) -> SearchResult:
    """Largest batch that fits, to within `tolerance` of itself: the answer fits and answer * (1 + tolerance) did not
    (so, memory growing with the batch, twice the answer does not fit either), unless the answer is `cap`."""
    if spec.device == "cpu" and budget_bytes is None:
        raise BatchSearchError("--batch-size auto on a CPU needs --memory-budget (the peak RSS a process may reach)")
    result = SearchResult(batch_size=0, budget_bytes=budget_bytes, cap=cap)
    lo, hi = 0, None  # the largest size that fitted, the smallest that did not
    size = max(1, min(start, cap))
    while True:
        trial = run_trial(spec, size, budget_bytes)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m baselines.batch_finder",
        description="Find the largest per-device batch of a preset that fits (what baselines/run.py --batch-size auto"
                    " does), e.g. once on a node before launching with torchrun or SLURM. With --trial B: run one"
                    " trial (a few training steps on random data), print its peak memory as JSON, exit 3 on CUDA"
                    " out of memory.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--preset", required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--precision", choices=("32", "bf16-mixed", "16-mixed"), default="32")
    parser.add_argument("--threads", type=int, default=None, help="torch threads of each trial")
    parser.add_argument("--data-dir", default=None, help="where datasets are stored (default: ~/.cache/hivetrain/data)")
    parser.add_argument("--no-dataset", action="store_true",
                        help="the run trains on generated data: do not load the preset's dataset (by default a trial"
                             " holds it in memory, as the run does)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per trial")
    parser.add_argument("--memory-budget", default=None,
                        help="peak memory a batch may use: RSS on a CPU (required there), allocated memory on a GPU")
    parser.add_argument("--start", type=int, default=32, help="first batch size tried")
    parser.add_argument("--cap", type=int, default=MAX_BATCH, help="never answer more than this")
    parser.add_argument("--tolerance", type=float, default=1 / 8,
                        help="stop when the gap between fitting and failing sizes is this fraction of the answer")
    parser.add_argument("--trial", type=int, default=None, metavar="B", help="run one trial at batch B and exit")
    args = parser.parse_args(argv)
    if args.trial is not None:
        code = _trial(args)
        # Straight out: the interpreter's teardown of torch grows RSS by ~100 MB for a moment, which the parent's
        # budget watch would count against this batch size.
        sys.stdout.flush()
        os._exit(code)
    try:
        budget = parse_bytes(args.memory_budget) if args.memory_budget else None
        spec = TrialSpec(args.preset, args.device, args.precision, args.threads, args.data_dir, args.steps,
                         load_dataset=not args.no_dataset)
        result = find_batch_size(spec, budget, start=args.start, cap=args.cap, tolerance=args.tolerance)
    except (ValueError, BatchSearchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"largest batch that fits: {result.batch_size}", flush=True)
    return 0


def _trial(args: argparse.Namespace) -> int:
    import resource

    import torch
    import torch.nn.functional as F

    from hivetrain.config import get_preset
    from hivetrain.model import autocast_dtype, create_model
    from hivetrain.module import make_optimizer

    if args.threads:
        torch.set_num_threads(args.threads)
    config = get_preset(args.preset)
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
