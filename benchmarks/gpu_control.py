"""The GPU proof's controls: what else the swarm and the single process are held against (run by
benchmarks/gpu_proof.py).

1. two plain processes sharing the GPU (`measure_control`): two `python -m benchmarks.gpu_speed` at the swarm's batch
   and precision on the same GPU at once, with no swarm, their timed windows started at the same moment
   (gpu_speed's --ready-dir). The swarm's two peers share the GPU in the same way, so what these two lose against
   one process alone is the cost of two processes time-slicing one GPU, and the swarm's samples/s over theirs
   (`ratio_to_control` of gpu_swarm.swarm_figures) is what the swarm costs on top of that;
2. the single process compiled (`compile_figures`): `benchmarks.gpu_speed --compile` against the eager reference, and
   the issue's target for it (COMPILE_RATIO_TARGET).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from benchmarks.gpu_speed import OOM_EXIT, why_it_failed
from benchmarks.gpu_swarm import SWARM_PRECISION, mean_gpu_util

ROOT = Path(__file__).resolve().parent.parent
CONTROL_PROCESSES = 2  # as many as the swarm's peers
READY_TIMEOUT_S = 90  # a process waits this long for the other's warm-up before it times its window alone
# Both processes' start, warm-up and exit (about half a minute on a GPU machine) may take this long, on top of the
# wait for each other and the timed window.
CONTROL_START_AND_EXIT_S = 90
# The windows count as overlapped when they share at least this much of the longer one: whole steps make each end up
# to a step after the common start + --seconds, and a step at batch 1024 is a few per cent of a 6-10 s window.
OVERLAP_MIN_SHARE = 0.9
COMPILE_RATIO_TARGET = 1.2  # the compiled single process's samples/s over the eager one's (the target)
COMPILE_TIMEOUT_S = 300  # start, compilation (a minute or so for ViT-B/32 on a GPU machine), warm-up, timed window
COMPILE_OVERRUN_S = 30  # the compiled run, the proof's last, is stopped this long after the proof's budget ends
COMPILE_WARMUP_STEPS = 10  # at least: the first step compiles, and a recompilation would come in the next few
# A step's result while it runs: what the page shows when SIGTERM ends the proof in it.
STOPPED_WHILE_RUNNING = "not finished: the proof was stopped (SIGTERM) while it ran"


def run_together(commands: list[list[str]], logs: list[Path], timeout: float) -> list[Optional[int]]:
    """Start every command at once (from the repository root), each writing to its log, and wait for all of them.

    Args:
        commands: the command lines, started in this order without waiting in between.
        logs: one log file per command; each starts with its command line.
        timeout: seconds to wait for all of them.

    Returns:
        Each command's exit status; None for one stopped here: after `timeout`, or once another failed (the others
        would wait for it in vain), or when the proof is stopped (SIGTERM, raised again after stopping them).
    """
    processes: list[subprocess.Popen] = []
    stopped: list[subprocess.Popen] = []
    try:
        for command, log in zip(commands, logs):
            with log.open("w") as out:
                out.write(f"$ {shlex.join(command)}\n")
                out.flush()
                processes.append(subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        while any(process.poll() is None for process in processes):
            if time.monotonic() > deadline or any(process.poll() not in (None, 0) for process in processes):
                break
            time.sleep(0.5)
    finally:
        stopped = [process for process in processes if process.poll() is None]
        for process in stopped:
            process.terminate()
        for process in stopped:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    return [None if process in stopped else process.returncode for process in processes]


def read_result(log: Path, exit_code: Optional[int], batch: int, stopped_because: str) -> dict:
    """One control process's gpu_speed result from the last line of its log, with the log's name, or its error;
    `stopped_because` says why, when run_together stopped it (`exit_code` None)."""
    if exit_code is None:
        return dict(error=f"stopped: {stopped_because} (see {log.name})", log=log.name)
    if exit_code == OOM_EXIT:
        return dict(error=f"CUDA out of memory at batch {batch} with {CONTROL_PROCESSES} processes on the GPU",
                    log=log.name)
    output = log.read_text()
    if exit_code == 0:
        return dict(json.loads(output.strip().splitlines()[-1]), log=log.name)
    return dict(error=f"{why_it_failed(output, exit_code)} (see {log.name})", log=log.name)


def control_figures(runs: list[dict], single: Optional[dict]) -> dict:
    """The control's figures from its processes' gpu_speed results: their samples/s summed and over one process's
    (`single`, a gpu_speed result; None when it failed or did not run), and how far their timed windows overlapped."""
    samples_per_s = sum(run["train_samples_per_s"] for run in runs)
    single_rate = single.get("train_samples_per_s") if single and not single.get("error") else None
    starts = [run["window_start_time"] for run in runs]
    ends = [run["window_end_time"] for run in runs]
    longest = max(end - start for start, end in zip(starts, ends))
    overlap = max(0.0, min(ends) - max(starts))
    share = overlap / longest if longest > 0 else 0.0
    return dict(samples_per_s=round(samples_per_s, 1), single_samples_per_s=single_rate,
                ratio_to_single=samples_per_s / single_rate if single_rate else None,
                overlap_s=round(overlap, 3), overlap_share=round(share, 4), overlapped=share >= OVERLAP_MIN_SHARE,
                overlap_min_share=OVERLAP_MIN_SHARE)


def measure_control(batch: int, seconds: float, artifacts: Path, clock, single: Optional[dict], *,
                    train_samples: int, seed: int, warmup_steps: int, options: tuple[str, ...] = ()) -> dict:
    """Two plain `benchmarks.gpu_speed` processes at `batch` in SWARM_PRECISION on the GPU at once, their timed
    windows of at least `seconds` started together: each one's result, and `control_figures`.

    Args:
        batch: each process's batch (the swarm's).
        seconds: each timed window's length (at least).
        artifacts: where the processes' logs, the GPU recording and the raw nvidia-smi views go.
        clock: gpu_proof's Clock (its `zero` and `say`).
        single: the single process's gpu_speed result at this batch, the figure the sum is held against.
        train_samples: the synthetic training split's size.
        seed: the first process's seed; the second's is one more (another data order).
        warmup_steps: untimed steps before each process waits for the other.
        options: gpu_speed options after all of those (the tests run it on a CPU, small).
    """
    from benchmarks.gpu_usage import RunMonitor

    label = f"control-{SWARM_PRECISION}"
    # The machine's CPUs are shared between the two as DDP's ranks share them, for their DataLoader workers.
    workers = max(1, (os.cpu_count() or 2) // CONTROL_PROCESSES - 1)
    ready_dir = Path(tempfile.mkdtemp(prefix="hivetrain-gpu-control-"))
    commands = [[sys.executable, "-m", "benchmarks.gpu_speed", "--precision", SWARM_PRECISION, "--batch-size",
                 str(batch), "--train-samples", str(train_samples), "--val-samples", "0", "--seed", str(seed + n),
                 "--warmup-steps", str(warmup_steps), "--seconds", f"{seconds:g}", "--num-workers", str(workers),
                 "--ready-dir", str(ready_dir), "--ready-count", str(CONTROL_PROCESSES), "--ready-timeout",
                 str(READY_TIMEOUT_S), *(["--dump-dir", str(artifacts), "--dump-label", label] if n == 0 else []),
                 *options] for n in range(CONTROL_PROCESSES)]
    logs = [artifacts / f"{label}-{n}.log" for n in range(CONTROL_PROCESSES)]
    timeout = CONTROL_START_AND_EXIT_S + READY_TIMEOUT_S + seconds
    clock.say(f"control, {SWARM_PRECISION}: {CONTROL_PROCESSES} plain processes (benchmarks.gpu_speed) at batch"
              f" {batch} on the GPU at once, timed together for {seconds:g} s")
    # the windows' times are time.time(); the NVML series counts seconds since the proof's zero (time.monotonic())
    wall_zero = time.time() - (time.monotonic() - clock.zero)
    artifacts.mkdir(parents=True, exist_ok=True)
    with RunMonitor(artifacts, label, clock.zero) as monitor:
        try:
            exit_codes = run_together(commands, logs, timeout)
        finally:
            shutil.rmtree(ready_dir, ignore_errors=True)
    stopped_because = ("the other process failed" if any(code not in (None, 0) for code in exit_codes) else
                       f"the processes did not finish within {timeout:g} s")
    runs = [dict(read_result(log, code, batch, stopped_because), seed=seed + n)
            for n, (log, code) in enumerate(zip(logs, exit_codes))]
    result: dict = dict(processes=CONTROL_PROCESSES, batch_size=batch, precision=SWARM_PRECISION, seconds=seconds,
                        runs=runs, logs=[log.name for log in logs])
    errors = [f"process {n}: {run['error']}" for n, run in enumerate(runs) if run.get("error")]
    if errors:
        result["error"] = "; ".join(errors)
    else:
        result.update(control_figures(runs, single))
        window = (max(run["window_start_time"] for run in runs) - wall_zero,
                  min(run["window_end_time"] for run in runs) - wall_zero)
        util, over = mean_gpu_util(monitor.recording["nvml_series"], *window) if result["overlap_s"] else (None, "")
        result.update(gpu_util_percent=util, gpu_util_over=over)
    result["recording"] = dict(monitor.recording, nvidia_smi_dumps=runs[0].get("nvidia_smi_dumps", []))
    if "error" in result:
        clock.say(f"control: failed: {result['error']}")
    else:
        ratio = result["ratio_to_single"]
        each = " + ".join(f"{run['train_samples_per_s']:,.0f}" for run in runs)
        clock.say(f"control: {each} = {result['samples_per_s']:,.0f} training samples/s"
                  + (f", {ratio:.3f} of one process's" if ratio else "")
                  + f"; windows overlapped {100 * result['overlap_share']:.0f}%"
                  + ("" if result["overlapped"] else f" (under {100 * OVERLAP_MIN_SHARE:.0f}%: not a fair control)"))
    return result


def compile_figures(compiled: dict, eager: Optional[dict]) -> dict:
    """The compiled single process's samples/s over the eager one's at the same batch, and the target.

    Args:
        compiled: the gpu_speed result of the --compile run (an error: no ratio).
        eager: the eager single process's gpu_speed result (None, an error or another batch: no ratio).
    """
    eager_rate = eager.get("train_samples_per_s") if eager and not eager.get("error") else None
    comparable = (eager_rate and not compiled.get("error") and compiled.get("batch_size") == eager.get("batch_size"))
    ratio = compiled["train_samples_per_s"] / eager_rate if comparable else None
    return dict(eager_samples_per_s=eager_rate, ratio_to_eager=ratio, ratio_target=COMPILE_RATIO_TARGET,
                ratio_target_met=None if ratio is None else ratio >= COMPILE_RATIO_TARGET)


def why_skipped(skip_flag: bool, flag: str, clock) -> Optional[str]:
    """Why a step of the proof does not run: its `flag` (a --no-... option) was given, or the budget is spent
    (clock.spent()'s words); None: it runs."""
    return f"skipped: {flag} was given" if skip_flag else clock.spent()


def run_control(proof: dict, args, artifacts: Path, clock) -> None:
    """The gpu_proof's step: two plain processes sharing the GPU at the swarm's batch and precision
    (`measure_control`), held against the reference's single process, into proof["control"]; skipped by
    --no-control or a spent budget.

    Args:
        proof: the proof's result; its reference's single process has run (or failed, or was skipped).
        args: gpu_proof's parsed command line.
        artifacts: where the runs' files go.
        clock: gpu_proof's Clock (its budget, `spent`, and `say`).
    """
    if (skipped := why_skipped(args.no_control, "--no-control", clock)) is not None:
        proof["control"] = dict(error=skipped)
    else:
        proof["control"] = dict(error=STOPPED_WHILE_RUNNING)  # replaced by its result unless SIGTERM comes first
        proof["control"] = measure_control(args.swarm_batch, args.speed_seconds, artifacts, clock,
                                            proof["reference"]["single"], train_samples=args.train_samples,
                                            seed=args.seed, warmup_steps=args.warmup_steps)
        return
    clock.say(f"control: {proof['control']['error']}")
