"""The GPU proof: ViT-B/32 at 224 px measured on this machine's CUDA GPUs, written up in logbook/gpu.md.

    python -m benchmarks.gpu_proof          # or: make gpu-proof
    python -m benchmarks.gpu_proof --train-samples 10000 --val-samples 2000 --precisions bf16-mixed --no-swarm

    python -m benchmarks.gpu_proof --precisions bf16-mixed --no-search --speed-seconds 6 --swarm-minutes 1.0 \
        --swarm-inner-steps 60 --budget-minutes 7.5

On synthetic data shaped like CIFAR-10 (hivetrain/synthetic_data.py); the defaults aim at a few minutes per step, and
no step starts after --budget-minutes (9); the short form above takes about 7 minutes on one H100:

1. the largest batch per precision (32, bf16-mixed, 16-mixed), found against the GPU's real memory by the project's
   batch finder (baselines/batch_finder.py); with --no-search, none: every precision runs at --swarm-batch;
2. training and validation samples/s and peak GPU memory (torch.cuda.max_memory_allocated) at that batch on one GPU
   (benchmarks/gpu_speed.py), and with DDP on every GPU of the machine when it has 2 or more;
3. the reference at the swarm's batch (--swarm-batch, bf16-mixed): one process with the project's loader
   (benchmarks/gpu_speed.py) and the pure-compute ceiling with the card's measured bf16 matrix rate
   (benchmarks/gpu_ceiling.py);
4. the control (benchmarks/gpu_control.py; --no-control skips it): two plain processes (benchmarks/gpu_speed.py) at
   the swarm's batch and precision on the same GPU at once, their timed windows started together, with no swarm:
   what two processes time-slicing one GPU cost, their windows' wall-clock times showing that they overlapped;
5. a 2-peer swarm of the synthetic-vit-b32 preset sharing the GPU, each peer at --swarm-batch, in the variants of
   --swarm-variants (diloco with rounds overlapped, blocking, and paced in seconds, or one peer alone on the GPU;
   benchmarks/gpu_swarm.py): its samples/s against the reference's and the control's, GPU utilisation, each peer's
   time in rounds and waits, MFU;
6. the single process compiled (benchmarks/gpu_speed.py --compile; --no-compile-run skips it) at the swarm's batch and
   precision, compilation in its untimed warm-up: its samples/s against the eager reference's (target 1.2 times). It
   runs last, so that a compilation that takes long cannot take the swarm's time; where torch.compile cannot run,
   the page says why in one line.

Every run is recorded: an NVML series of each GPU's utilisation and memory every second, nvidia-smi's CSV log, and
raw `nvidia-smi` and `nvidia-smi -q -d MEMORY,UTILIZATION` text. The JSON result and those files go to
logbook/gpu-results/; the page (benchmarks/gpu_page.py) is rendered from the result alone.

Without a CUDA GPU it says so in one line and exits 0. The swarm needs hivemind: on a machine without network, bring
the wheels of scripts/prepare-gpu-wheelhouse.sh in .whl/; when hivemind is missing, this installs them with
`python3 -m pip install -q --no-index --no-deps --no-compile --target SITE .whl/*.whl` and puts SITE on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from benchmarks.gpu_control import (COMPILE_OVERRUN_S, COMPILE_TIMEOUT_S, COMPILE_WARMUP_STEPS, STOPPED_WHILE_RUNNING,
                                    compile_figures, run_control, why_skipped)
from benchmarks.gpu_speed import OOM_EXIT, PRECISIONS, PRESET, why_it_failed
from benchmarks.harness import git_commit
from benchmarks.gpu_swarm import (OWN_REFERENCE_RUN, SWARM_PRECISION, SWARM_VARIANTS, ensure_hivemind,
                                  measure_ceiling, measure_swarm_variants, new_swarm_result, prepend_pythonpath)

ROOT = Path(__file__).resolve().parent.parent
NO_CUDA_LINE = "No CUDA GPU here: the GPU proof needs one; nothing was run."
NO_SEARCH = "skipped: --no-search was given"  # the page shows one line instead of the search's table
SPEED_TIMEOUT_S = 420  # one speed run: start, warm-up, timed window, validation pass; DDP start included
OOM_RETRIES = 2  # a speed run that runs out of memory at the found batch tries again 1/8 smaller, this many times


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_proof",
        description="Measure ViT-B/32 (timm vit_base_patch32_224, random init, 10 classes) at 224 px on this"
                    " machine's CUDA GPUs, on synthetic data shaped like CIFAR-10: the largest batch per precision"
                    " (the project's batch finder), samples/s and peak GPU memory at it on one GPU and with DDP on"
                    " all GPUs (when 2 or more), the single process and the pure-compute ceiling at the swarm's"
                    " batch, two plain processes sharing the GPU (the control), a 2-peer swarm sharing the GPU"
                    " (diloco, rounds overlapped and blocking) and one peer alone on it held against them, and the"
                    " single process with"
                    " torch.compile against the eager one; record nvidia-smi and NVML"
                    " while each run lasts; write logbook/gpu.md and a JSON result under logbook/gpu-results/."
                    " Without a CUDA GPU it prints one line and exits 0.",
        epilog="On a machine without network the swarm's hivemind comes from .whl/ (scripts/prepare-gpu-wheelhouse.sh"
               " fills it where there is network); baselines/README.md, section 'GPU proof', has the exact commands.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    data = parser.add_argument_group("data (synthetic, seeded random images shaped like CIFAR-10)")
    data.add_argument("--train-samples", type=int, default=50_000, help="training split size")
    data.add_argument("--val-samples", type=int, default=10_000, help="validation split size (0: no validation)")
    data.add_argument("--seed", type=int, default=0, help="seed of the images, labels and data order")
    runs = parser.add_argument_group("what to measure")
    runs.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS),
                      help="precisions to search and measure, in this order")
    runs.add_argument("--no-search", action="store_true",
                      help="skip the batch search: every precision's speed is measured at --swarm-batch")
    runs.add_argument("--search-start", type=int, default=1024,
                      help="first batch the search tries (later precisions start from the largest answer so far)")
    runs.add_argument("--search-cap", type=int, default=16384,
                      help="the largest batch the search tries (and at most --train-samples): the baselines' 4096 cap"
                           " was reached at every precision on an H200")
    runs.add_argument("--search-tolerance", type=float, default=1 / 8,
                      help="the search stops when fitting and failing sizes are within this fraction of the answer")
    runs.add_argument("--warmup-steps", type=int, default=5, help="untimed training steps before the timed window")
    runs.add_argument("--speed-seconds", type=float, default=15.0, help="length of each timed training window")
    runs.add_argument("--swarm-minutes", type=float, default=1.5,
                      help="how long each swarm's peers train (--max-time; their start, ~30-40 s, comes on top)")
    runs.add_argument("--swarm-batch", type=int, default=1024,
                      help="each swarm peer's batch (bf16-mixed), and the batch of the single-process reference and"
                           " the ceiling it is held against")
    runs.add_argument("--swarm-inner-steps", type=int, default=100,
                      help="the swarm's diloco inner steps per round (the coordinator's --inner-steps)")
    runs.add_argument("--no-swarm", action="store_true", help="skip the 2-peer swarm")
    runs.add_argument("--swarm-variants", nargs="+", choices=list(SWARM_VARIANTS), default=list(SWARM_VARIANTS),
                      metavar="NAME", help="the swarm variants to run, in this order, of: " + ", ".join(
                          f"{name} ({variant.peers} peer(s), coordinator {' '.join(variant.coordinator)})"
                          for name, variant in SWARM_VARIANTS.items()))
    runs.add_argument("--no-control", action="store_true",
                      help="skip the control: two plain processes (benchmarks.gpu_speed) sharing the GPU at the"
                           " swarm's batch, timed together for --speed-seconds, the swarm's table held against them")
    runs.add_argument("--no-compile-run", action="store_true",
                      help="skip the single process with torch.compile (benchmarks.gpu_speed --compile) at the swarm's"
                           " batch, held against the eager one (target 1.2 times); it runs last, compilation untimed")
    runs.add_argument("--budget-minutes", type=float, default=9.0,
                      help="start no step after this many minutes; the steps left are recorded as skipped (the"
                           " result and page are written after every step, so a proof cut off keeps what it did)")
    out = parser.add_argument_group("output")
    out.add_argument("--out", type=Path, default=Path("logbook"), help="where gpu.md and its plots go")
    out.add_argument("--results", type=Path, default=Path("logbook/gpu-results"),
                     help="where the JSON result and the raw nvidia-smi files go")
    out.add_argument("--commit", default=None,
                     help="the commit measured, for a copy of the repository without .git (default: git rev-parse"
                          " HEAD)")
    deps = parser.add_argument_group("hivemind on a machine without network")
    deps.add_argument("--wheelhouse", type=Path, default=ROOT / ".whl",
                      help="wheels from scripts/prepare-gpu-wheelhouse.sh, installed when hivemind is missing")
    deps.add_argument("--site", type=Path, default=Path("/tmp/hivetrain-site"),
                      help="the folder they are installed into (pip --target), put on PYTHONPATH")
    args = parser.parse_args(argv)
    if args.train_samples < 1:
        parser.error("--train-samples must be at least 1")
    if args.val_samples < 0 or args.warmup_steps < 0 or args.seed < 0:
        parser.error("--val-samples, --warmup-steps and --seed must be 0 or more")
    if args.swarm_batch < 1 or args.swarm_inner_steps < 1:
        parser.error("--swarm-batch and --swarm-inner-steps must be at least 1")
    if args.search_start < 1 or args.search_cap < args.search_start:
        parser.error("--search-start must be at least 1 and at most --search-cap")
    if not 0 < args.search_tolerance <= 1:
        parser.error("--search-tolerance must be more than 0 and at most 1")
    if args.speed_seconds <= 0 or args.swarm_minutes <= 0 or args.budget_minutes <= 0:
        parser.error("--speed-seconds, --swarm-minutes and --budget-minutes must be more than 0")
    if len(set(args.precisions)) != len(args.precisions):
        parser.error("--precisions lists a precision twice")
    if len(set(args.swarm_variants)) != len(args.swarm_variants):
        parser.error("--swarm-variants lists a variant twice")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(NO_CUDA_LINE, flush=True)
        return 0
    return run_proof(args, "python -m benchmarks.gpu_proof" + (" " + shlex.join(argv if argv is not None
                                                                                  else sys.argv[1:])).rstrip())


class ProofStopped(RuntimeError):
    """SIGTERM reached the proof (a time limit, `timeout`, a machine given back): the step running ends here."""


class Clock:
    """Seconds since the proof started, in front of every line it prints, and the proof's time budget."""

    def __init__(self, budget_minutes: float = float("inf")):
        self.zero = time.monotonic()
        self.budget_minutes = budget_minutes
        self.stopped = False

    def stop_on_sigterm(self) -> None:
        """SIGTERM ends the step running (its processes are stopped, its logs kept) and skips the rest; the result
        and page are saved as they stand."""
        def stop(signum, frame):
            if not self.stopped:
                self.stopped = True
                raise ProofStopped("the proof was stopped (SIGTERM) while this step ran")

        signal.signal(signal.SIGTERM, stop)

    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self.zero:5.0f} s] {message}", flush=True)

    def spent(self) -> Optional[str]:
        """Why the next step must not start (the proof was stopped, or its budget is spent), or None."""
        if self.stopped:
            return "skipped: the proof was stopped (SIGTERM) before it"
        if time.monotonic() - self.zero < self.budget_minutes * 60:
            return None
        return f"skipped: the proof's {self.budget_minutes:g}-minute budget (--budget-minutes) was spent before it"

    def left_s(self) -> float:
        """Seconds of the budget left (0 when it is spent)."""
        return max(0.0, self.budget_minutes * 60 - (time.monotonic() - self.zero))


def run_proof(args: argparse.Namespace, command: str) -> int:
    import torch

    from benchmarks.gpu_usage import write_nvidia_smi_dumps
    from hivetrain.synthetic_data import DATA_ORIGIN, IMAGE_SHAPE, NUM_CLASSES
    from hivetrain.config import get_preset
    from hivetrain.files import atomic_write

    clock = Clock(args.budget_minutes)
    clock.stop_on_sigterm()
    name = f"gpu-proof-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}"
    artifacts = args.results / name
    artifacts.mkdir(parents=True, exist_ok=True)
    # Roles and workers are started as scripts and modules of this checkout, which need not be pip-installed.
    prepend_pythonpath(ROOT)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random init everywhere: nothing to fetch from the hub
    swarm_skipped = "--no-swarm was given" if args.no_swarm else ensure_hivemind(args.wheelhouse, args.site,
                                                                                 clock.say)
    environment = describe_environment(args.commit)
    gpu_count = torch.cuda.device_count()
    clock.say(f"{name}: {', '.join(g['name'] for g in environment['gpus']) or 'GPUs'}; {gpu_count} visible to CUDA;"
              f" torch {environment['torch']} (CUDA {environment['cuda']}); data: {DATA_ORIGIN}")
    model = get_preset(PRESET).model
    proof = dict(
        kind="gpu-proof", example=False, name=name, command=command, artifacts=name, environment=environment,
        data=dict(origin=DATA_ORIGIN, image_shape=list(IMAGE_SHAPE), num_classes=NUM_CLASSES,
                  train_samples=args.train_samples, val_samples=args.val_samples, seed=args.seed),
        model=dict(name=model.name, img_size=model.img_size, num_classes=model.num_classes, pretrained=False,
                   optimizer_preset=PRESET),
        settings=dict(search=not args.no_search, search_start=args.search_start, search_cap=args.search_cap,
                      search_tolerance=args.search_tolerance,
                      warmup_steps=args.warmup_steps, speed_seconds=args.speed_seconds,
                      swarm_minutes=args.swarm_minutes, swarm_batch=args.swarm_batch,
                      swarm_inner_steps=args.swarm_inner_steps, swarm_variants=args.swarm_variants,
                      control=not args.no_control, compile_run=not args.no_compile_run,
                      budget_minutes=args.budget_minutes),
        start_dumps=write_nvidia_smi_dumps(artifacts, "start"), precisions=[],
        ddp_note=(f"DDP ran on all {gpu_count} GPUs (one process each, NCCL) at each precision's single-GPU batch"
                  " per GPU." if gpu_count >= 2 else
                  f"DDP: not run, this machine has {gpu_count} CUDA GPU; it runs on every local GPU when there are 2"
                  " or more."),
        reference=dict(batch_size=args.swarm_batch, precision=SWARM_PRECISION, single=None, single_from=None,
                       ceiling=None),
        control=None, compiled=None,  # None: not reached
        swarm=new_swarm_result(args.swarm_variants, args.swarm_minutes, args.swarm_batch, args.swarm_inner_steps,
                               swarm_skipped),
        finished=False, wall_time_s=0.0,
    )
    result_path = args.results / f"{name}.json"

    def save() -> Path:
        """The result and page as they stand: a proof cut off (a time limit, a lost machine) keeps every step done."""
        from benchmarks.gpu_page import render_gpu_page

        proof["wall_time_s"] = round(time.monotonic() - clock.zero, 1)
        atomic_write(result_path, json.dumps(proof, indent=1) + "\n")
        return render_gpu_page(proof, args.out, args.results)

    try:
        start = args.search_start
        for precision in args.precisions:
            not_reached = dict(strategy="single", error="not reached: the proof stopped before this run")
            entry: dict = dict(precision=precision, single=not_reached, ddp=None)
            proof["precisions"].append(entry)
            if skipped := clock.spent():
                entry["search"] = dict(error=skipped)
                entry["single"] = dict(strategy="single", error=skipped)
                clock.say(f"batch search and speed, {precision}: {skipped}")
                continue
            if args.no_search:
                entry["search"] = dict(error=f"{NO_SEARCH}; speed measured at --swarm-batch {args.swarm_batch}")
                found = args.swarm_batch
            else:
                entry["search"] = search_batch(precision, start, args, artifacts, clock)
                save()
                found = entry["search"].get("batch_size")
            if not found:
                entry["single"] = dict(strategy="single", error="not measured: the batch search gave no answer")
                continue
            start = max(start, found)
            entry["single"] = measure_speed(precision, found, 1, args, artifacts, clock)
            save()
            if gpu_count >= 2:
                # What one GPU could run, per GPU, as long as the training split holds a batch for every GPU.
                batch = min(entry["single"].get("batch_size", found), args.train_samples // gpu_count)
                if skipped := clock.spent():
                    entry["ddp"] = dict(strategy="ddp", devices=gpu_count, error=skipped)
                elif not batch:
                    entry["ddp"] = dict(strategy="ddp", devices=gpu_count,
                                        error=f"not measured: --train-samples {args.train_samples} holds no batch for"
                                              f" each of {gpu_count} GPUs")
                else:
                    entry["ddp"] = measure_speed(precision, batch, gpu_count, args, artifacts, clock)
                save()

        measure_reference(proof, args, artifacts, clock, save)
        run_control(proof, args, artifacts, clock)
        save()
        if swarm_skipped is None:
            proof["swarm"]["skipped"] = None
            reference = proof["reference"]
            for variant in args.swarm_variants:
                proof["swarm"]["variants"] += measure_swarm_variants(
                    [variant], args.swarm_minutes, args.swarm_batch, args.swarm_inner_steps, artifacts, clock,
                    single=reference["single"], ceiling=reference["ceiling"], control=proof["control"])
                save()
        else:
            clock.say(f"swarm: not run: {swarm_skipped}")
        measure_compiled(proof, args, artifacts, clock)
    except ProofStopped as e:  # in a batch search, speed or ceiling run; a swarm records it as that variant's error
        clock.say(str(e))
    proof["finished"] = not clock.stopped
    page = save()
    clock.say(f"wrote {page}, {result_path} and the raw files in {artifacts}/")
    return 143 if clock.stopped else 0


def describe_environment(commit: Optional[str]) -> dict:
    """The commit, date, machine, GPUs (from NVML) and versions the page names."""
    import torch

    from benchmarks.gpu_usage import nvml_gpus
    from hivetrain.run_result import cpu_name

    gpus, driver = nvml_gpus()
    try:
        from importlib.metadata import version

        hivemind = version("hivemind")
    except Exception:  # PackageNotFoundError, or a broken install: the page says "not installed"
        hivemind = None
    try:
        cudnn = str(torch.backends.cudnn.version())
    except (RuntimeError, AssertionError):
        # its version check may initialise CUDA, which raises without a driver (torch.cuda.is_available() is no guard:
        # once Lightning has set PYTORCH_NVML_BASED_CUDA_CHECK=1 in the process, it counts the devices torch reports)
        cudnn = None
    return dict(
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), commit=commit or git_commit(),
        host=platform.node(), cpu=cpu_name(), python=platform.python_version(), torch=torch.__version__,
        cuda=torch.version.cuda, cudnn=cudnn, hivemind=hivemind, driver=driver,
        gpus=gpus, cuda_device_count=torch.cuda.device_count(),
    )


def search_batch(precision: str, start: int, args: argparse.Namespace, artifacts: Path, clock: Clock) -> dict:
    """The batch finder's search on the GPU for `precision`, on generated data (no dataset loaded)."""
    from hivetrain.batch_size import BatchSearchError, TrialSpec, find_batch_size
    from hivetrain.config import get_preset
    from benchmarks.gpu_usage import RunMonitor

    spec = TrialSpec(get_preset(PRESET), "cuda", precision, load_dataset=False)
    cap = min(args.search_cap, args.train_samples)
    clock.say(f"batch search, {precision}: from {min(start, cap)}, at most {cap}")
    with RunMonitor(artifacts, f"search-{precision}", clock.zero) as monitor:
        try:
            result = find_batch_size(spec, None, start=min(start, cap), cap=cap, tolerance=args.search_tolerance,
                                     log=lambda line: clock.say(f"  {line}")).to_dict()
        except BatchSearchError as e:
            result = dict(error=str(e))
    result["recording"] = monitor.recording
    if "error" in result:
        clock.say(f"batch search, {precision}: failed: {result['error']}")
    else:
        clock.say(f"batch search, {precision}: {result['batch_size']} per GPU ({len(result['trials'])} trials)")
    return result


def measure_speed(precision: str, batch: int, devices: int, args: argparse.Namespace, artifacts: Path,
                  clock: Clock, label: Optional[str] = None, options: tuple[str, ...] = (),
                  timeout: float = SPEED_TIMEOUT_S) -> dict:
    """benchmarks.gpu_speed at `batch` per GPU on `devices` GPUs; 1/8 smaller after an out-of-memory, up to
    OOM_RETRIES times (the search's trial holds a little less than a training loop does). `label` names its log
    and recording files (default: speed-PRECISION-STRATEGY); `options` go to gpu_speed after the proof's own (the
    last of an option given twice counts); `timeout` is each attempt's limit in seconds."""
    from benchmarks.gpu_usage import RunMonitor
    from hivetrain.formatting import fmt_bytes

    strategy = "single" if devices == 1 else "ddp"
    shown = f"speed, {precision} {strategy} x{devices}" + (f" ({label})" if label else "")  # its progress lines
    label = label or f"speed-{precision}-{strategy}{devices if devices > 1 else ''}"
    attempts: list[dict] = []
    result: dict = dict(strategy=strategy, devices=devices)
    log = artifacts / f"{label}.log"
    with RunMonitor(artifacts, label, clock.zero) as monitor, log.open("w") as out:
        for _ in range(1 + OOM_RETRIES):
            command = [sys.executable, "-m", "benchmarks.gpu_speed", "--precision", precision, "--batch-size",
                       str(batch), "--devices", str(devices), "--train-samples", str(args.train_samples),
                       "--val-samples", str(args.val_samples), "--seed", str(args.seed), "--warmup-steps",
                       str(args.warmup_steps), "--seconds", str(args.speed_seconds), "--dump-dir", str(artifacts),
                       "--dump-label", label, *options]
            out.write(f"$ {shlex.join(command)}\n")
            out.flush()
            try:
                done = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
            except subprocess.TimeoutExpired:
                result["error"] = f"failed: did not finish within {timeout:g} s (see {log.name})"
                break
            if done.returncode == OOM_EXIT:
                attempts.append(dict(batch_size=batch, out_of_memory=True))
                clock.say(f"speed, {precision} {strategy}: out of memory at batch {batch}; trying {batch * 7 // 8}")
                batch = batch * 7 // 8
                if batch < 1:
                    break
                continue
            out.flush()
            if done.returncode != 0:
                result["error"] = f"failed: {why_it_failed(log.read_text(), done.returncode)} (see {log.name})"
                break
            last = log.read_text().strip().splitlines()[-1]
            result = dict(json.loads(last), strategy=strategy)
            attempts.append(dict(batch_size=batch, out_of_memory=False))
            break
    if "error" not in result and (not attempts or attempts[-1]["out_of_memory"]):
        tried = ", ".join(str(a["batch_size"]) for a in attempts)
        result["error"] = f"failed: CUDA out of memory at every batch tried ({tried})"
    result["attempts"] = attempts
    result["log"] = log.name
    result["recording"] = dict(monitor.recording, nvidia_smi_dumps=result.get("nvidia_smi_dumps", []))
    if "error" in result:
        clock.say(f"{shown}: {result['error']}")
    else:
        peaks = [p for p in result["peak_memory_bytes"] if p is not None]  # None: a rank on a CPU
        clock.say(f"{shown}: batch {result['batch_size']}, "
                  f"{result['train_samples_per_s']:,.0f} training samples/s, "
                  f"{result['val_samples_per_s'] or 0:,.0f} validation samples/s, peak GPU memory "
                  f"{fmt_bytes(max(peaks, default=None))}")
    return result


def measure_reference(proof: dict, args: argparse.Namespace, artifacts: Path, clock: Clock, save) -> None:
    """The single process and the pure-compute ceiling at the swarm's batch and precision, into proof["reference"]:
    the single process is the speed run above when one ran at that batch and precision, else measured here."""
    reference = proof["reference"]
    same = next((entry["single"] for entry in proof["precisions"] if entry["precision"] == SWARM_PRECISION
                 and not entry["single"].get("error") and entry["single"]["batch_size"] == args.swarm_batch), None)
    if same is not None:
        reference.update(single=same, single_from=f"the {SWARM_PRECISION} single-GPU speed run above")
    elif skipped := clock.spent():
        reference["single"] = dict(strategy="single", error=skipped)
    else:
        reference.update(single=measure_speed(SWARM_PRECISION, args.swarm_batch, 1, args, artifacts, clock,
                                              label=f"reference-{SWARM_PRECISION}"),
                         single_from=OWN_REFERENCE_RUN)
        save()
    if skipped := clock.spent():
        reference["ceiling"] = dict(error=skipped)
    else:
        reference["ceiling"] = measure_ceiling(args.swarm_batch, args.speed_seconds, artifacts, clock)
    save()


def measure_compiled(proof: dict, args: argparse.Namespace, artifacts: Path, clock: Clock) -> None:
    """The single process with torch.compile (gpu_speed --compile) at the swarm's batch and precision, compilation in
    its untimed warm-up and no validation pass, held against the reference's eager single process, into
    proof["compiled"]; skipped by --no-compile-run or a spent budget, and stopped COMPILE_OVERRUN_S after the
    budget ends (a compilation can take minutes: the proof's total stays within the budget and a little)."""
    if (skipped := why_skipped(args.no_compile_run, "--no-compile-run", clock)) is not None:
        proof["compiled"] = dict(error=skipped)
    else:
        proof["compiled"] = dict(error=STOPPED_WHILE_RUNNING)  # replaced by its result unless SIGTERM comes first
        warmup = max(args.warmup_steps, COMPILE_WARMUP_STEPS)
        clock.say(f"compiled, {SWARM_PRECISION}: one process with torch.compile at batch {args.swarm_batch};"
                  f" compilation in its {warmup} untimed warm-up steps")
        compiled = measure_speed(SWARM_PRECISION, args.swarm_batch, 1, args, artifacts, clock,
                                 label=f"compiled-{SWARM_PRECISION}",
                                 timeout=min(COMPILE_TIMEOUT_S, clock.left_s() + COMPILE_OVERRUN_S),
                                 options=("--compile", "--val-samples", "0", "--warmup-steps", str(warmup)))
        proof["compiled"] = dict(compiled, **compile_figures(compiled, proof["reference"]["single"]))
        ratio, target = proof["compiled"]["ratio_to_eager"], proof["compiled"]["ratio_target"]
        if ratio is not None:
            clock.say(f"compiled: {ratio:.3f} of the eager process's samples/s (target {target:g}); the first step,"
                      f" with compilation, took {compiled['first_step_seconds']:.0f} s")
        return
    clock.say(f"compiled: {proof['compiled']['error']}")


if __name__ == "__main__":
    sys.exit(main())
