"""The monitor suite: what one look at the swarm costs the coordinator as the swarm grows to hundreds of peers.

Training peers fill this machine's two cores long before that, so the peers here are lightweight publishers
(benchmarks/publishers.py): DHT-only stand-ins that publish a peer's metrics and progress records as often as a
training peer does, each signed with its own key. Figures come from the coordinator's events (each look and how long
it took) and its metrics store (how many peers each look counted).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from benchmarks.harness import Process, start_coordinator

PUBLISHERS = (16, 64, 256)
PER_PROCESS = 64  # simulated peers per publisher process (they share its p2p daemon)
LOOK_EVERY = 2.0  # seconds between the coordinator's looks (--refresh)
WINDOW_S, SMOKE_WINDOW_S = 60.0, 7.0  # a smoke run's window: three looks or more


def monitor_suite(work: Path, smoke: bool) -> dict:
    from hivetrain.telemetry import PUBLISH_EVERY

    window_s = SMOKE_WINDOW_S if smoke else WINDOW_S
    # before the window: every simulated peer has refreshed its records once (a full run's steady state), or, in a
    # smoke run, the coordinator has looked twice since each published its first
    settle_s = 2 * LOOK_EVERY if smoke else 2 * PUBLISH_EVERY
    results = [monitor_run(work, count, window_s, settle_s) for count in (PUBLISHERS[:1] if smoke else PUBLISHERS)]
    return dict(results=results, per_process=PER_PROCESS)


def monitor_run(work: Path, count: int, window_s: float, settle_s: float) -> dict:
    """A coordinator (a look every LOOK_EVERY s) and `count` publishers: its looks, the peers it counted and its CPU
    and memory over `window_s` seconds, from `settle_s` seconds after every simulated peer has published."""
    from benchmarks.harness import MONITOR_ONLY
    from hivetrain.metrics_store import MetricsReader

    name = f"monitor-{count}"
    roles: list[Process] = []
    try:
        coordinator, addresses = start_coordinator(work, name, [*MONITOR_ONLY, "--refresh", f"{LOOK_EVERY:g}"])
        roles.append(coordinator)
        run_id = coordinator.event("serving")["run_id"]
        processes = -(-count // PER_PROCESS)
        for index in range(processes):
            share = count // processes + (index < count % processes)
            roles.append(Process(["-m", "benchmarks.publishers", "--initial-peers", *addresses, "--run-id",
                                  run_id, "--count", str(share), "--name", f"{name}-{index}"],
                                 work / f"{name}-publishers-{index}.log",
                                 events=work / f"{name}-publishers-{index}.events"))
        for publishers in roles[1:]:
            publishers.wait_for_event("publishing", timeout=300)
        time.sleep(settle_s)
        started = time.time()
        time.sleep(window_s)
        ended = time.time()
        main, descendants = coordinator.cpu_between(started, ended)
        rss = coordinator.rss_bytes()
        looks = [e["seconds"] for e in coordinator.events("look") if started <= e["time"] <= ended]
        with MetricsReader(work / name / "metrics.sqlite") as reader:
            counted = [s.alive_peers for s in reader.snapshots(since=started) if s.time <= ended]
        if not looks or not counted:
            raise RuntimeError(f"the coordinator of {name} made no look in the window; see {coordinator.log}")
        result = dict(
            publishers=count, window_s=ended - started, looks=len(looks),
            look_median_s=statistics.median(looks), look_max_s=max(looks),
            counted_median=statistics.median(counted), counted_min=min(counted),
            coordinator_cpu_percent=100 * (main + descendants), coordinator_rss_bytes=rss)
        print(f"{count} publishers: a look in {result['look_median_s']:.3f} s (median of {len(looks)}),"
              f" {result['counted_median']:.0f} counted, coordinator at"
              f" {result['coordinator_cpu_percent']:.1f}% of a core", flush=True)
        return result
    finally:
        for role in reversed(roles):
            role.stop()


def monitor_section(result: dict, env: dict, out: Path) -> str:
    from benchmarks.report import measured_by, verdict
    from hivetrain.swarm import RECORD_LIFETIME
    from hivetrain.telemetry import PEER_RECORD_TTL, PUBLISH_EVERY

    rows = "".join(
        f"| {r['publishers']} | {r['look_median_s']:.3f} | {r['look_max_s']:.3f} | {r['counted_median']:.0f} |"
        f" {r['counted_min']} | {r['coordinator_cpu_percent']:.1f} | {r['coordinator_rss_bytes'] / 2**20:.0f} |\n"
        for r in result["results"])
    largest = max(result["results"], key=lambda r: r["publishers"])
    return (
        "## monitor\n\n"
        f"{measured_by(env)} A coordinator (no validation, a look every 2 s) and N lightweight"
        f" publishers (`benchmarks/publishers.py`, {result['per_process']} per process): DHT-only stand-ins for"
        f" peers that store a signed metrics record and a signed hivemind progress record every {PUBLISH_EVERY:.0f} s"
        f" (±20%), each under its own key, with the lifetimes real peers use ({PEER_RECORD_TTL:.0f} s and"
        f" {RECORD_LIFETIME:.0f} s). Over {result['results'][0]['window_s']:.0f} s: how long a look takes (reading both"
        " keys, vetting every entry, writing the store), how many peers each look counted, and the coordinator's CPU"
        " and memory with its DHT, state-holder and p2pd processes (100% = one core). The publishers run on the same"
        " two cores.\n\n"
        "| publishers | a look, median (s) | slowest look (s) | counted, median | counted, fewest |"
        " coordinator CPU % | coordinator RSS (MiB) |\n|---:|---:|---:|---:|---:|---:|---:|\n"
        f"{rows}\n"
        "Target: a look under 1 s with 256 publishers "
        + verdict(largest["publishers"] >= 256 and largest["look_max_s"] < 1,
                   f"slowest {largest['look_max_s']:.2f} s with {largest['publishers']}") + "\n"
    )
