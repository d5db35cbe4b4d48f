"""The join suite: time from `peers/join.py` start to the swarm's state loaded, and to its first local step, for
the tiny preset and for ViT-B/32's full state (python -m benchmarks.bench join)."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness import MONITOR_ONLY, ROOT, Process, reached_epoch, start_coordinator, start_peer
from benchmarks.report import measured_by, verdict


IMPORT_STACK = ["torch", "hivemind", "lightning.pytorch", "timm"]  # what a peer imports before it can do anything


def import_seconds(repeats: int) -> dict[str, float]:
    """Median seconds a fresh interpreter takes to import torch, then torch + hivemind, and so on."""
    seconds = {}
    for depth in range(1, len(IMPORT_STACK) + 1):
        modules = ", ".join(IMPORT_STACK[:depth])
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            subprocess.run([sys.executable, "-c", f"import {modules}"], cwd=ROOT, check=True, capture_output=True)
            times.append(time.perf_counter() - started)
        seconds[modules] = statistics.median(times)
    return seconds

JOIN_RUNS = (("demo", 5), ("digits-vit-b32", 3))  # preset, peers that join
LONE_JOINERS = 3  # a lone joiner of the tiny preset, alone with the coordinator on the idle machine, this many times
CPU_EVERY = 0.1  # seconds between two samples of a joiner's CPU time: its CPU seconds to the first step within that


def join_suite(work: Path, smoke: bool) -> dict:
    """For the tiny preset and for ViT-B/32's full state: a coordinator and a seed peer that keeps training; peers
    join one after another. For each: seconds from its process start to "Joined the swarm" (state downloaded) and to
    its first local step. A smoke run: one joiner of the tiny preset."""
    imports = import_seconds(repeats=1 if smoke else 3)  # on the idle machine, before any role starts
    lone = lone_join_run(work, "demo", 1 if smoke else LONE_JOINERS)  # also on the idle machine: first
    runs = [join_run(work, preset, 1 if smoke else joiners) for preset, joiners in (JOIN_RUNS[:1] if smoke else
                                                                                     JOIN_RUNS)]
    return dict(runs=runs, import_seconds=imports, lone=lone)


def _join_one(work: Path, name: str, addresses: list[str], roles: list[Process]) -> dict:
    """A peer called `name` joins, takes 3 steps and leaves: its seconds from its process start to its state loaded
    and to its first local step, and the CPU seconds (its own and its processes') to that step, sampled every
    CPU_EVERY s."""
    joiner = start_peer(work, name, addresses, ["--threads", "1", "--max-steps", "3"], cpu_every=CPU_EVERY)
    roles.append(joiner)
    loaded = joiner.wait_for_event("state_loaded", timeout=300)
    stepped = joiner.wait_for_event("first_step", timeout=300)
    joiner.popen.wait(300)
    joined = dict(state_loaded_s=loaded["time"] - joiner.started, first_step_s=stepped["time"] - joiner.started,
                  first_step_cpu_s=joiner.cpu_seconds(stepped["time"]), epoch=loaded["epoch"])
    print(f"{name}: state loaded after {joined['state_loaded_s']:.1f} s (epoch {joined['epoch']}), first step after"
          f" {joined['first_step_s']:.1f} s and {joined['first_step_cpu_s']:.1f} CPU s", flush=True)
    return joined


def lone_join_run(work: Path, preset: str, joiners: int) -> dict:
    """A coordinator and nothing else; peers join one after another, each alone in the swarm while it starts (the
    state it loads is the coordinator's): what a volunteer's own machine spends to its first step."""
    roles: list[Process] = []
    try:
        coordinator, addresses = start_coordinator(work, f"lone-{preset}", MONITOR_ONLY, preset)
        roles.append(coordinator)
        results = [_join_one(work, f"lone-{preset}-joiner-{index}", addresses, roles) for index in range(joiners)]
        return dict(preset=preset, joiners=results,
                    median_first_step_s=statistics.median(r["first_step_s"] for r in results),
                    median_first_step_cpu_s=statistics.median(r["first_step_cpu_s"] for r in results))
    finally:
        for role in reversed(roles):
            role.stop()


def join_run(work: Path, preset: str, joiners: int) -> dict:
    from hivetrain.config import get_preset

    roles: list[Process] = []
    try:
        coordinator, addresses = start_coordinator(work, f"join-{preset}", MONITOR_ONLY, preset)
        roles.append(coordinator)
        seed = start_peer(work, f"join-{preset}-seed", addresses, ["--threads", "1"])
        roles.append(seed)
        deadline = time.monotonic() + 600
        while reached_epoch(seed) < 3:  # a state worth downloading
            if time.monotonic() > deadline or seed.popen.poll() is not None:
                raise RuntimeError(f"the seed peer did not reach epoch 3; see {seed.log}")
            time.sleep(0.2)
        results = [_join_one(work, f"join-{preset}-joiner-{index}", addresses, roles) for index in range(joiners)]
        return dict(preset=preset, model=get_preset(preset).model.name, joiners=results,
                    median_state_loaded_s=statistics.median(r["state_loaded_s"] for r in results),
                    median_first_step_s=statistics.median(r["first_step_s"] for r in results))
    finally:
        for role in reversed(roles):
            role.stop()


def _cpu(joiner: dict) -> str:
    """A joiner's CPU seconds to its first step, in a table cell; results from before they were measured have none."""
    return f" {joiner['first_step_cpu_s']:.1f} |" if "first_step_cpu_s" in joiner else ""


def _lone_section(lone: dict) -> str:
    """The lone joiner's table and issue 28's targets: its first step within 5 s and 4 CPU seconds."""
    rows = "".join(f"| {i} | {r['first_step_s']:.1f} |{_cpu(r)}\n" for i, r in enumerate(lone["joiners"]))
    wall, cpu = lone["median_first_step_s"], lone["median_first_step_cpu_s"]
    return (
        f"### A lone joiner (`{lone['preset']}`)\n\n"
        "The coordinator alone on the idle machine, before the runs below; peers join one after another, each alone"
        " in the swarm while it starts. CPU seconds: the joiner's own and its processes' (DHT, averagers, p2pd), from"
        f" its start to its first local step, sampled every {CPU_EVERY:g} s.\n\n"
        "| joiner | first local step (s) | CPU seconds to it |\n|---:|---:|---:|\n"
        f"{rows}\n"
        "Targets: a lone joiner's first step within 5 s, spending at most 4 CPU seconds. "
        + verdict(wall <= 5, f"median {wall:.1f} s") + " "
        + verdict(cpu <= 4, f"median {cpu:.1f} CPU s") + "\n\n"
    )


def join_section(result: dict, env: dict, out: Path) -> str:
    tables = _lone_section(result["lone"]) if "lone" in result else ""
    for run in result["runs"]:
        with_cpu = all("first_step_cpu_s" in r for r in run["joiners"])
        rows = "".join(f"| {i} | {r['epoch']} | {r['state_loaded_s']:.1f} | {r['first_step_s']:.1f} |"
                       f"{_cpu(r) if with_cpu else ''}\n" for i, r in enumerate(run["joiners"]))
        header = ("| joiner | joined at epoch | state loaded (s) | first local step (s) |"
                  + (" CPU seconds to it |\n|---:|---:|---:|---:|---:|\n" if with_cpu else "\n|---:|---:|---:|---:|\n"))
        tables += (
            f"### `{run['preset']}` ({run['model']})\n\n"
            f"{header}"
            f"{rows}\n"
            f"Median: state loaded after {run['median_state_loaded_s']:.1f} s, first local step after"
            f" {run['median_first_step_s']:.1f} s.\n\n"
        )
    tiny = next(run for run in result["runs"] if run["preset"] == "demo")
    return (
        "## join\n\n"
        f"{measured_by(env)} For each preset, a coordinator and a seed peer training it on loopback (one"
        " torch thread each); peers join one after another and download the seed's state (parameters and AdamW"
        " statistics). Seconds from the joiner's process start. `digits-vit-b32` is ViT-B/32 with its full state"
        " (88M parameters, random weights) on 32 px digits.\n\n"
        f"{tables}"
        "Target: first local step within 10 s for the tiny preset (plain hivemind 1.1.12 measured 7.8 s to state"
        " loaded and 9.2 s to the first step on this kind of machine). "
        + verdict(tiny["median_first_step_s"] <= 10, f"median first step {tiny['median_first_step_s']:.1f} s") + "\n\n"
        "Where the time goes before anything runs: a fresh interpreter's imports, measured on the idle machine before"
        " the roles start (median of 3):\n\n| imports | seconds |\n|---|---:|\n"
        + "".join(f"| {modules} | {seconds:.1f} |\n" for modules, seconds in result["import_seconds"].items())
    )
