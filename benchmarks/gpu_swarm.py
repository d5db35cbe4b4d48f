"""The GPU proof's swarm in the mission's shape, and what it is held against (run by benchmarks/gpu_proof.py).

1. the pure-compute ceiling at the swarm's batch: `python -m benchmarks.gpu_ceiling` (data already on the GPU), which
   also measures the card's bf16 matrix rate and counts the training FLOPs per image (`measure_ceiling`);
2. a coordinator of the `synthetic-vit-b32` preset (ViT-B/32 at 224 px, random init, CIFAR-10-shaped noise) in diloco
   mode and two `peers/join.py --device cuda --batch-size B --precision bf16-mixed` sharing the GPU, in each variant of
   SWARM_VARIANTS: rounds overlapped with the next inner steps, blocking, or overlapped and paced in seconds; or one
   peer alone on the GPU, a volunteer's own card, whose rounds have nobody to average with
   (`measure_swarm_variants`);
3. per variant (`swarm_figures`): the peers' summed samples/s against the single process's samples/s at the same batch
   (benchmarks.gpu_speed, measured by gpu_proof) and against two plain processes sharing the GPU (the control of
   benchmarks/gpu_control.py), the GPU's NVML utilisation while both peers trained, each peer's shares of its training
   time in swarm rounds and in waits for overlapped rounds, and the swarm's MFU.

SWARM_VARIANTS names each variant's coordinator options: another variant is one more entry, and gpu_proof's
--swarm-variants picks which of them a proof runs. The swarm needs hivemind: `ensure_hivemind` installs it from a
wheelhouse on a machine without network.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple, Optional

ROOT = Path(__file__).resolve().parent.parent
SWARM_PRESET = "synthetic-vit-b32"
SWARM_PRESET_NOTE = ("ViT-B/32 (88M parameters) at 224 px, random init, on seeded noise shaped like CIFAR-10: the"
                     " mission's model and training step with no dataset to bring along")
SWARM_PRECISION = "bf16-mixed"  # the precision the mission's GPU peers train in


class SwarmVariant(NamedTuple):
    coordinator: list[str]  # the coordinator's options (coordinator_args)
    peers: int = 2  # peers on the GPU


# The mission's diloco rounds either run in the background while the next inner steps train, or stop training for
# every round: the proof measures both, so the page shows what overlapping buys.
SWARM_VARIANTS = {
    "diloco-overlapped": SwarmVariant(["--mode", "diloco", "--overlap-rounds"]),
    "diloco-blocking": SwarmVariant(["--mode", "diloco", "--no-overlap-rounds"]),
    # rounds paced in seconds (each peer's inner steps from its own speed, groups looked for ahead), overlapped: about
    # as many steps a round as the 60 above on an H100 shared by two peers (--inner-steps then paces the LR only)
    "diloco-paced": SwarmVariant(["--mode", "diloco", "--overlap-rounds", "--round-seconds", "10"]),
    # A volunteer's own card: one peer, no time-slicing with another process, its rounds its own outer steps. Held
    # against the single process, it is what the peer itself costs (Lightning's loop, the strategy, the rounds' copies).
    "diloco-one-peer": SwarmVariant(["--mode", "diloco", "--overlap-rounds"], peers=1),
}
RATIO_TARGET = 0.90  # the swarm's samples/s over one process's at the same batch (issue 26, item 6)
RATIO_STRETCH = 0.96
CEILING_TIMEOUT_S = 300  # model build, FLOP count, warm-up, timed window and the matrix-rate repeats
CEILING_KEYS = ("samples_per_s", "bf16_matmul_flops", "train_flops_per_image", "mfu")
OWN_REFERENCE_RUN = "a speed run of its own"  # the reference's single_from when no speed run above was at its batch


def coordinator_args(variant: str, inner_steps: int) -> list[str]:
    """What run_swarm passes the coordinator after --preset, --host, --port and --validate-every 0."""
    if variant not in SWARM_VARIANTS:
        raise ValueError(f"swarm variant {variant!r} is not one of {', '.join(SWARM_VARIANTS)}")
    return [*SWARM_VARIANTS[variant].coordinator, "--inner-steps", str(inner_steps)]


def prepend_pythonpath(path: Path) -> None:
    """Put `path` first on PYTHONPATH, for the processes this one starts."""
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(path) not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(path), *parts])


def ensure_hivemind(wheelhouse: Path, site: Path, say=print) -> Optional[str]:
    """None when hivemind can be imported, after installing it from `wheelhouse` into `site` (on PYTHONPATH) if it
    was missing; otherwise why the swarm cannot run."""
    if importlib.util.find_spec("hivemind") is None and not (site / "hivemind").is_dir():
        wheels = sorted(wheelhouse.glob("*.whl"))
        if not wheels:
            return (f"hivemind is not installed and {wheelhouse} holds no wheels: run scripts/prepare-gpu-wheelhouse.sh"
                    " where there is network and bring .whl/ along")
        command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                   "--target", str(site), *map(str, wheels)]
        say(f"installing hivemind and its dependencies from {wheelhouse} ({len(wheels)} wheels) into {site}")
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
            return f"installing the wheels of {wheelhouse} failed: {tail}"
    if importlib.util.find_spec("hivemind") is None:
        sys.path.insert(0, str(site))
        prepend_pythonpath(site)
        importlib.invalidate_caches()
        if importlib.util.find_spec("hivemind") is None:
            return f"hivemind is neither installed nor in {site}"
    return None


def peer_args(minutes: float, batch: int) -> list[str]:
    # After run_swarm's own --threads 1 (the last one counts): a peer's rounds and state transfers of ViT-B/32's 88M
    # parameters run on the CPU, where one thread would leave most of a GPU machine's cores idle. The batch is given
    # as a number: `auto`, a GPU peer's default, would search and might pick another batch than the reference's.
    threads = max(1, min(8, (os.cpu_count() or 2) // 4))
    return ["--device", "cuda", "--max-time", f"{minutes:g}", "--threads", str(threads), "--batch-size", str(batch),
            "--precision", SWARM_PRECISION]


def new_swarm_result(variants: list[str], minutes: float, batch: int, inner_steps: int,
                     skipped: Optional[str]) -> dict:
    """The result's swarm before any variant ran: what it will run (the commands as run_swarm of benchmarks.harness
    starts them, less their --identity, --log-dir and --name in a scratch folder) and the ratio it aims at.

    Args:
        variants: the keys of SWARM_VARIANTS the proof will run, in order.
        minutes: each peer's --max-time.
        batch: each peer's batch.
        inner_steps: the coordinator's --inner-steps.
        skipped: why the swarm will not run, or None.
    """
    coordinator_commands = {variant: shlex.join([
        "python", "coordinator/start.py", "--preset", SWARM_PRESET, "--host", "127.0.0.1", "--port", "0",
        "--validate-every", "0", *coordinator_args(variant, inner_steps)]) for variant in variants}
    peer_command = shlex.join(["python", "peers/join.py", "--initial-peers", "COORDINATOR_ADDRESS", "--min-peers",
                               "PEERS", "--seed", "PEER_INDEX", "--progress-bar", "off", *peer_args(minutes, batch)])
    return dict(preset=SWARM_PRESET, preset_note=SWARM_PRESET_NOTE, batch_size=batch,
                variant_peers={variant: SWARM_VARIANTS[variant].peers for variant in variants},
                precision=SWARM_PRECISION, inner_steps=inner_steps, ratio_target=RATIO_TARGET,
                ratio_stretch=RATIO_STRETCH, coordinator_commands=coordinator_commands, peer_command=peer_command,
                variants=[], skipped=skipped or "not reached: the proof stopped before the swarm")


def parse_ceiling_output(text: str) -> dict:
    """gpu_ceiling's result: its last line, JSON with at least CEILING_KEYS; ValueError when it is not that."""
    lines = text.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        result = None
    if not isinstance(result, dict) or any(not isinstance(result.get(key), (int, float)) for key in CEILING_KEYS):
        raise ValueError(f"benchmarks.gpu_ceiling did not end with its JSON result (last line: {lines[-1:]})")
    return result


def measure_ceiling(batch: int, seconds: float, artifacts: Path, clock, options: tuple[str, ...] = ()) -> dict:
    """benchmarks.gpu_ceiling at `batch` in SWARM_PRECISION for `seconds`, its log and GPU recording in `artifacts`;
    `options` go on to it after those (the tests run it on a CPU with a small image and matrix)."""
    from benchmarks.gpu_usage import RunMonitor

    label = f"ceiling-{SWARM_PRECISION}"
    log = artifacts / f"{label}.log"
    command = [sys.executable, "-m", "benchmarks.gpu_ceiling", "--batch-size", str(batch), "--precision",
               SWARM_PRECISION, "--seconds", f"{seconds:g}", *options]
    clock.say(f"ceiling, {SWARM_PRECISION}: batch {batch}, data on the GPU, then the card's bf16 matrix rate")
    with RunMonitor(artifacts, label, clock.zero) as monitor, log.open("w") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        try:
            done = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=CEILING_TIMEOUT_S)
            result = (dict(error=f"failed: exit code {done.returncode} (see {log.name})") if done.returncode
                      else None)
        except subprocess.TimeoutExpired:
            result = dict(error=f"failed: did not finish within {CEILING_TIMEOUT_S} s (see {log.name})")
    if result is None:
        try:
            result = parse_ceiling_output(log.read_text())
        except ValueError as e:
            result = dict(error=f"failed: {e} (see {log.name})")
    result.update(log=log.name, recording=monitor.recording)
    if "error" in result:
        clock.say(f"ceiling: {result['error']}")
    else:
        clock.say(f"ceiling: {result['samples_per_s']:,.0f} samples/s, {result['bf16_matmul_flops'] / 1e12:,.0f}"
                  f" bf16 TFLOP/s measured, MFU {100 * result['mfu']:.1f}%")
    return result


def mean_gpu_util(series: list[dict], start_s: float, end_s: float) -> tuple[Optional[float], str]:
    """The mean NVML utilisation (%, over every GPU's samples) between `start_s` and `end_s` (seconds since the
    proof's zero, as the series' time_s), and what it was taken over: the window, or the whole recorded run when no
    sample fell inside the window; (None, ...) without samples."""
    inside = [s["util_percent"] for s in series if start_s <= s["time_s"] <= end_s]
    if inside:
        return sum(inside) / len(inside), "window"
    every = [s["util_percent"] for s in series]
    return (sum(every) / len(every) if every else None), "run"


def swarm_figures(samples_per_s: float, single: Optional[dict], ceiling: Optional[dict],
                  control: Optional[dict] = None) -> dict:
    """The swarm's samples/s held against the single process's (`single`: a gpu_speed result), two plain processes'
    sharing the GPU (`control`: gpu_control.measure_control's result) and the ceiling's MFU denominator (`ceiling`: a
    gpu_ceiling result); a figure whose reference failed or was not run is None."""
    single_rate = single.get("train_samples_per_s") if single and not single.get("error") else None
    control_rate = control.get("samples_per_s") if control and not control.get("error") else None
    ratio = samples_per_s / single_rate if single_rate else None
    mfu = None
    if ceiling and not ceiling.get("error"):
        mfu = samples_per_s * ceiling["train_flops_per_image"] / ceiling["bf16_matmul_flops"]
    return dict(single_samples_per_s=single_rate, ratio_to_single=ratio,
                ratio_target_met=None if ratio is None else ratio >= RATIO_TARGET,
                ratio_stretch_met=None if ratio is None else ratio >= RATIO_STRETCH, mfu=mfu,
                control_samples_per_s=control_rate,
                ratio_to_control=samples_per_s / control_rate if control_rate else None)


def time_shares(left_events: list[dict]) -> dict:
    """Each peer's shares of its training time (its 'left' event): stood still for swarm rounds and state downloads,
    waiting for overlapped rounds to finish, and with a round in flight (overlapped rounds' wall time)."""
    def share(event: dict, key: str) -> Optional[float]:
        return event[key] / event["train_seconds"] if event.get("train_seconds") and key in event else None

    return dict(wait_share=[share(event, "wait_seconds") for event in left_events],
                communication_share=[share(event, "communication_seconds") for event in left_events])


def measure_swarm_variants(variants: list[str], minutes: float, batch: int, inner_steps: int, artifacts: Path,
                           clock, single: Optional[dict] = None, ceiling: Optional[dict] = None,
                           control: Optional[dict] = None) -> list[dict]:
    """A swarm on the GPU in each of `variants` (keys of SWARM_VARIANTS): a coordinator of SWARM_PRESET and the
    variant's peers (two sharing the GPU, or one alone), each `peers/join.py --device cuda --max-time MINUTES --batch-size BATCH --precision bf16-mixed` on loopback,
    as benchmarks.harness's run_swarm starts them; samples/s of both peers together from their epoch events while both
    trained (benchmarks.harness.swarm_window), and the figures of `swarm_figures` (against `single`, `ceiling` and
    `control`) and `time_shares`. The roles' logs are kept in `artifacts`; `clock` is gpu_proof's Clock."""
    from benchmarks.harness import run_swarm, swarm_window
    from benchmarks.gpu_usage import RunMonitor, write_nvidia_smi_dumps

    options = {variant: coordinator_args(variant, inner_steps) for variant in variants}  # refuses unknown ones first
    results = []
    for variant in variants:
        if skipped := clock.spent():
            results.append(dict(variant=variant, error=skipped))
            clock.say(f"swarm, {variant}: {skipped}")
            continue
        label = f"swarm-{variant}"
        work = Path(tempfile.mkdtemp(prefix=f"hivetrain-gpu-{label}-"))
        peers_count = SWARM_VARIANTS[variant].peers
        clock.say(f"swarm, {variant}: a coordinator and {peers_count} peer(s) at batch {batch} on the GPU, training"
                  f" {minutes:g} min")
        result: dict = dict(variant=variant, coordinator_options=options[variant], peers=peers_count)
        # event times are time.time(); the NVML series counts seconds since the proof's zero (time.monotonic())
        wall_zero = time.time() - (time.monotonic() - clock.zero)
        # The raw views are taken once, about half-way through the peers' training (they start after ~30-40 s).
        dump = threading.Timer(40 + minutes * 30, write_nvidia_smi_dumps, (artifacts, label))
        with RunMonitor(artifacts, label, clock.zero) as monitor:
            dump.start()
            try:
                coordinator, peers = run_swarm(work, label, peers_count, options[variant], peer_args(minutes, batch),
                                               timeout=minutes * 60 + 240, preset=SWARM_PRESET)
                result.update(swarm_window(coordinator, peers))
                started = max(peer.event("training_started")["time"] for peer in peers) - wall_zero
                result.update(window_start_s=round(started, 1), window_end_s=round(started + result["window_s"], 1),
                              **time_shares([peer.event("left") for peer in peers]))
            except RuntimeError as e:  # a role failed, printed too little, or SIGTERM: its log, kept below, says why
                result["error"] = str(e).replace(str(work), str(artifacts))
            finally:
                dump.cancel()
                # kept even when the proof is stopped here: the roles' logs say how far the swarm got
                result["logs"] = []
                for log in sorted(work.glob(f"{label}*.log")):
                    shutil.copy(log, artifacts / log.name)
                    result["logs"].append(log.name)
                shutil.rmtree(work, ignore_errors=True)
        result["recording"] = dict(monitor.recording, nvidia_smi_dumps=sorted(
            p.name for p in artifacts.glob(f"{label}.nvidia-smi*.txt")))
        if "error" in result:
            clock.say(f"swarm, {variant}: failed: {result['error']}")
        else:
            util, over = mean_gpu_util(monitor.recording["nvml_series"], result["window_start_s"],
                                       result["window_end_s"])
            # the control is two processes sharing the GPU: no measure for a peer that has the GPU to itself
            result.update(gpu_util_percent=util, gpu_util_over=over, **swarm_figures(
                result["samples_per_s"], single, ceiling, control if peers_count == 2 else None))
            ratio, to_control = result["ratio_to_single"], result["ratio_to_control"]
            clock.say(f"swarm, {variant}: {result['samples_per_s']:,.0f} samples/s over {result['window_s']:.0f} s,"
                      f" {result['epochs']} rounds" + (f", {ratio:.3f} of one process's" if ratio else "")
                      + (f", {to_control:.3f} of two plain processes'" if to_control else ""))
        results.append(result)
    return results
