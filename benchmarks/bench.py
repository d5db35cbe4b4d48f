"""Benchmarks whose numbers land in the logbook: python -m benchmarks.bench SUITE [--smoke | --page].

Each suite starts real roles (coordinator/start.py, peers/join.py) as processes on loopback (benchmarks.harness) and
measures them from what they write for programs: their events, the coordinator's metrics store and run records, never
their console lines. It keeps a record, logbook/bench-records/bench-SUITE-<time>.json (the suite, the command, the
machine, versions, commit and date, and the result), and writes its section of logbook/benchmarks.md, or its page,
from it. --page measures nothing: it writes the section or page again from the suite's newest record.

Suites here: join (time from `peers/join.py` start to the swarm's state loaded, and to its first local step);
throughput (samples/s of single, DDP and a swarm on equal hardware, and the swarm's time outside compute); links (DDP
and both swarm modes between two network namespaces over a veth shaped to 1 Gbit/s, 100 and 20 Mbit/s);
communication (loopback bytes per sample and accuracy with no compression, fp16 and 8-bit); convergence (validation
top-1 against samples seen for single, DDP and the swarm); churn (peers leaving and joining); monitor (the
coordinator's look); attacks (one malicious peer in four under each defence, in logbook/reliability.md); scale (what
each peer costs as the swarm grows, and joiner storms, extrapolated: benchmarks.scale, the whole of logbook/scale.md).

A suite is a function (work folder, smoke) -> JSON-able result and a function (result, environment, page folder) ->
its Markdown, registered in SUITES: a section ("## SUITE") of its page, or a whole page ("# ..."). The environment it
gets also names the command that measured it and the record's path.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.churn import churn_section, churn_suite
from benchmarks.defences import attacks_section, attacks_suite
from benchmarks.harness import (MONITOR_ONLY, ROOT, Process, evaluate_weights, reached_epoch, run_baseline, run_swarm,
                                start_coordinator, start_peer, swarm_window, validated_epoch)
from benchmarks.monitor import monitor_section, monitor_suite
from benchmarks.report import measured_by, verdict
from benchmarks.scale import scale_page, scale_suite

PAGE = ROOT / "logbook" / "benchmarks.md"
RECORDS = ROOT / "logbook" / "bench-records"  # not run records: logbook/records holds only those, which the logbook reads


THROUGHPUT_PRESET = "digits-vit-tiny"  # ViT-Tiny at 32 px: as much compute per sample as plain hivemind was measured on
# sync: target batch as a multiple of the per-step batch and swarm epochs between state averaging rounds; diloco: inner
# steps per round (about 1 s each here, so a round a minute and four in the window); seconds of training
THROUGHPUT_SWARMS = (dict(mode="sync", multiple=4, state_every=1, seconds=75),
                     dict(mode="sync", multiple=8, state_every=1, seconds=75),
                     dict(mode="sync", multiple=8, state_every=10, seconds=90),
                     dict(mode="sync", multiple=32, state_every=1, seconds=150),
                     dict(mode="diloco", inner_steps=60, seconds=240))


def throughput_suite(work: Path, smoke: bool) -> dict:
    """Samples/s on equal hardware (two processes, one torch thread each; one process with two threads for single)
    of single, DDP and a 2-peer swarm, the swarm at target batches of 4x, 8x and 32x the per-step batch, and at 8x
    with parameter averaging every 10 swarm epochs instead of every one. DDP runs before and after the swarms: this
    machine's speed drifts, the mean of both is the reference."""
    batch = 32
    steps = 4 if smoke else 60  # DDP steps of 2 x 32 samples: over a minute here

    def ddp(name: str) -> dict:
        return run_baseline(work, name, ["--strategy", "ddp", "--devices", "2", "--threads", "1", "--batch-size",
                                         str(batch), "--epochs", "1000", "--max-steps", str(steps), "--val-limit",
                                         "0"], THROUGHPUT_PRESET)

    single = run_baseline(work, "single", ["--strategy", "single", "--threads", "2", "--batch-size", str(batch),
                                           "--epochs", "1000", "--max-steps", str(2 * steps), "--val-limit", "0"],
                          THROUGHPUT_PRESET)
    ddp_before = ddp("ddp-before")
    print(f"single: {single['samples_per_s']:.1f} samples/s; DDP: {ddp_before['samples_per_s']:.1f} samples/s",
          flush=True)
    swarms = []
    for setting in THROUGHPUT_SWARMS[:1] if smoke else THROUGHPUT_SWARMS:
        seconds = 30 if smoke else setting["seconds"]
        if setting["mode"] == "diloco":
            name, options = f"swarm-diloco-h{setting['inner_steps']}", ["--mode", "diloco", "--inner-steps",
                                                                          str(setting["inner_steps"])]
        else:
            name = f"swarm-{setting['multiple']}x-state{setting['state_every']}"
            options = ["--target-batch-size", str(setting["multiple"] * batch), "--average-state-every",
                       str(setting["state_every"])]
        coordinator, peers = run_swarm(work, name, 2, options, ["--batch-size", str(batch), "--max-time",
                                                                 f"{seconds / 60:.4f}"], timeout=seconds + 180,
                                       preset=THROUGHPUT_PRESET)
        result = swarm_window(coordinator, peers)
        result.update(setting, target_batch_size=setting.get("multiple", 0) * batch,
                      average_state_every=setting.get("state_every"))
        swarms.append(result)
        print(f"{name}: {result['samples_per_s']:.1f} samples/s, {result['epochs']} epochs, time in swarm rounds"
              f" {result['swarm_time_share']}, training {result['training_cores']:.2f} cores, background"
              f" {result['background_cores']:.2f}", flush=True)
    ddp_after = ddp("ddp-after")
    reference = (ddp_before["samples_per_s"] + ddp_after["samples_per_s"]) / 2
    for result in swarms:
        result["ratio_to_ddp"] = result["samples_per_s"] / reference
    print(f"DDP after the swarms: {ddp_after['samples_per_s']:.1f} samples/s", flush=True)
    return dict(preset=THROUGHPUT_PRESET, batch_size=batch, single_samples_per_s=single["samples_per_s"],
                ddp_samples_per_s=reference, ddp_runs_samples_per_s=[ddp_before["samples_per_s"],
                                                                    ddp_after["samples_per_s"]], swarms=swarms)


LINK_RATES_MBIT = (1000, 100, 20)  # a data-centre link, a good home line, a volunteer's typical uplink
LINK_DDP_STEPS = {1000: 30, 100: 15, 20: 6}  # DDP steps of 2 x 32 samples: about a minute at each rate
LINK_INNER_STEPS = 100  # diloco: inner steps per round (about 1 s each here), as a GPU volunteer would take hundreds
LINK_SWARM_SECONDS = 240  # at least two rounds of each peer


class LinkCounter(threading.Thread):
    """The bytes sent over a LinkedNamespaces link, sampled every half second while in a `with` block."""

    def __init__(self, network):
        super().__init__(daemon=True)
        self.network, self.samples = network, [(time.time(), network.sent_bytes())]
        self._stop_event = threading.Event()

    def __enter__(self) -> "LinkCounter":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop_event.set()
        self.join()
        self.samples.append((time.time(), self.network.sent_bytes()))

    def run(self) -> None:
        while not self._stop_event.wait(0.5):
            self.samples.append((time.time(), self.network.sent_bytes()))

    def between(self, start: float, end: float) -> int:
        """Bytes sent from the last sample at or before `start` to the first at or after `end` (a little wider)."""
        first = max((s for s in self.samples if s[0] <= start), default=self.samples[0])
        last = min((s for s in self.samples if s[0] >= end), default=self.samples[-1])
        return last[1] - first[1]


def links_ddp(work: Path, network, name: str, steps: int) -> dict:
    """DDP over the link: node 0 (one process) in namespace a, node 1 in b, gloo on the veth; its run record."""
    records = work / f"{name}-records"
    common = ["baselines/run.py", "--strategy", "ddp", "--num-nodes", "2", "--devices", "1", "--threads", "1",
              "--preset", THROUGHPUT_PRESET, "--batch-size", "32", "--epochs", "1000", "--max-steps", str(steps),
              "--val-limit", "0", "--progress-bar", "off", "--out-dir", str(work / name), "--record-dir",
              str(records)]
    nodes = [Process(common, work / f"{name}-node{rank}.log", prefix=network.exec_prefix(side),
                     env=dict(MASTER_ADDR=network.a_ip, MASTER_PORT="29533", NODE_RANK=str(rank),
                              GLOO_SOCKET_IFNAME=network.a_link if side == "a" else network.b_link))
             for rank, side in ((0, "a"), (1, "b"))]
    try:
        for node in nodes:
            if node.popen.wait(timeout=600) != 0:
                raise RuntimeError(f"DDP node of {name} failed (exit code {node.popen.returncode}); see {work}")
    finally:
        for node in nodes:
            node.stop()
    [record] = records.glob("*.json")
    return json.loads(record.read_text())


def links_suite(work: Path, smoke: bool) -> dict:
    """Two peers in network namespaces of their own, joined by one veth pair shaped to 1 Gbit/s, 100 Mbit/s and
    20 Mbit/s (tbf): samples/s and bytes over the link per trained sample for DDP (gloo over the same link), the sync
    swarm (target batch 8x the per-step batch) and the diloco swarm, on the throughput suite's preset."""
    from benchmarks.netns import LinkedNamespaces

    unavailable = LinkedNamespaces.unavailable()
    if unavailable:
        raise RuntimeError(f"the links suite needs network namespaces: {unavailable}")
    batch, seconds = 32, 30 if smoke else LINK_SWARM_SECONDS
    inner_steps = 4 if smoke else LINK_INNER_STEPS
    results = []
    # A smoke run shapes the link to 100 Mbit/s: at 20 DDP's steps and the joiners' state downloads alone took minutes
    for rate in LINK_RATES_MBIT[1:2] if smoke else LINK_RATES_MBIT:
        network = LinkedNamespaces(81).create()
        try:
            network.limit(rate)
            row = dict(rate_mbit=rate)
            sent = network.sent_bytes()
            ddp = links_ddp(work, network, f"links-{rate}-ddp", 2 if smoke else LINK_DDP_STEPS[rate])
            row["ddp"] = dict(samples_per_s=ddp["samples_per_s"], samples=ddp["train_samples"],
                              bytes_per_sample=(network.sent_bytes() - sent) / ddp["train_samples"])
            for mode, options in (("sync", ["--target-batch-size", str(8 * batch)]),
                                  ("diloco", ["--mode", "diloco", "--inner-steps", str(inner_steps)])):
                counter = LinkCounter(network)
                with counter:
                    _, peers = run_swarm(work, f"links-{rate}-{mode}", 2, options,
                                         ["--batch-size", str(batch), "--max-time", f"{seconds / 60:.4f}"],
                                         timeout=seconds + 240, preset=THROUGHPUT_PRESET, network=network)
                # Each peer's samples over its training time (first step to leaving), summed: on a slow link a sync
                # swarm may take too few epochs for the throughput suite's window between epochs. Bytes: those
                # sent from the moment both peers held the swarm's state to the last one's leaving.
                left = [peer.event("left") for peer in peers]
                started = max(peer.event("training_started")["time"] for peer in peers)
                samples = sum(event["samples"] for event in left)
                row[mode] = dict(samples_per_s=sum(event["samples"] / event["train_seconds"] for event in left),
                                 samples=samples, epochs=reached_epoch(peers[0]),
                                 bytes_per_sample=counter.between(started, max(e["time"] for e in left)) / samples,
                                 swarm_time_share=[event["swarm_seconds"] / event["train_seconds"] for event in left])
            print(f"{rate} Mbit/s: " + "; ".join(f"{kind} {row[kind]['samples_per_s']:.1f} samples/s,"
                                                 f" {row[kind]['bytes_per_sample'] / 1e3:.1f} kB per sample"
                                                 for kind in ("ddp", "sync", "diloco")), flush=True)
            results.append(row)
        finally:
            network.delete()
    return dict(preset=THROUGHPUT_PRESET, batch_size=batch, inner_steps=inner_steps, results=results)


def loopback_bytes() -> int:
    """Bytes sent over this machine's loopback interface so far (Linux's counters): every byte the roles of a
    loopback swarm send each other, DHT, averaging and state downloads alike."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "lo":
            return int(counters.split()[8])  # transmit bytes (on loopback, each byte is received once as well)
    raise RuntimeError("no loopback interface in /proc/net/dev: the communication suite needs Linux")


COMPRESSION_KINDS = ("none", "fp16", "8bit")
COMPRESSION_TARGETS = {"fp16": (0.5, 0.5), "8bit": (0.7, 1.0)}  # share of bytes saved, top-1 points it may cost


def communication_suite(work: Path, smoke: bool) -> dict:
    """For each compression (of gradients and of state alike): a 2-peer swarm trains the same number of swarm epochs;
    loopback bytes over the whole run (start-up, state downloads and leaving included) per sample trained, and the
    peers' validation top-1 at the end."""
    epochs = 3 if smoke else 30
    results = []
    for kind in COMPRESSION_KINDS[:2] if smoke else COMPRESSION_KINDS:
        sent_before = loopback_bytes()
        _, peers = run_swarm(work, f"comm-{kind}", 2, ["--grad-compression", kind, "--state-compression", kind],
                             ["--stop-at-epoch", str(epochs), "--save-weights", str(work / f"comm-{kind}-{{index}}.st")],
                             timeout=600)
        sent = loopback_bytes() - sent_before
        samples = sum(peer.event("left")["samples"] for peer in peers)
        weights = [work / f"comm-{kind}-{index}.st" for index in range(len(peers))]
        results.append(dict(compression=kind, epochs=epochs, samples=samples, bytes=sent, bytes_per_sample=sent / samples,
                            top1=evaluate_weights(weights)))
        print(f"{kind}: {sent / samples / 1e3:.1f} kB per sample over {samples} samples, top-1"
              f" {results[-1]['top1']}", flush=True)
    return dict(preset="demo", results=results)


CONVERGENCE_INNER_STEPS = 8  # diloco's H on the demo preset: a round per 512 samples of 2 peers
CONVERGENCE_SEEDS = 3  # data orders per diloco variant: one digit of the 360 held out is 0.28 points
# The grouped row: diloco averaging in groups of at most CONVERGENCE_GROUP_SIZE (--target-group-size) among
# CONVERGENCE_GROUPED_PEERS peers, so that each round has several groups and the parameters mix across rounds.
CONVERGENCE_GROUPED_PEERS, CONVERGENCE_GROUP_SIZE = 4, 2


def convergence_suite(work: Path, smoke: bool) -> dict:
    """Validation top-1 against samples seen for single, DDP and a 2-peer swarm of the demo preset: the same initial
    weights, data, LR schedule and samples per optimizer step (the swarm's target batch; the baselines accumulate to
    it), validated on the whole validation split."""
    from hivetrain.config import diloco_schedule_flags, get_preset
    from hivetrain.metrics_store import MetricsReader

    config = get_preset("demo")
    global_batch, batch = config.swarm.target_batch_size, config.batch_size
    data_epochs = 1 if smoke else 5
    single = run_baseline(work, "conv-single", ["--strategy", "single", "--threads", "2", "--batch-size", str(batch),
                                                "--accumulate", str(global_batch // batch), "--epochs",
                                                str(data_epochs)])
    ddp = run_baseline(work, "conv-ddp", ["--strategy", "ddp", "--devices", "2", "--threads", "1", "--batch-size",
                                          str(batch), "--accumulate", str(global_batch // batch // 2), "--epochs",
                                          str(data_epochs)])
    curves = {name: [(point["step"] * record["global_batch_size"], point["top1"]) for point in record["validation"]]
              for name, record in (("single", single), ("DDP", ddp))}
    swarm_epochs = single["train_samples"] // global_batch
    # The peers train until the coordinator has validated the swarm's state at that epoch or later: the coordinator
    # downloads each state from them, so they must still be there (on this preset they are far faster than it).
    run_swarm(work, "conv-swarm", 2, ["--validate-every", "1", "--threads", "1", "--refresh", "2"], [],
              timeout=900, until=lambda: validated_epoch(work / "conv-swarm" / "metrics.sqlite") >= swarm_epochs)
    with MetricsReader(work / "conv-swarm" / "metrics.sqlite") as store:
        curves["swarm"] = [(row.epoch * global_batch, row.top1) for row in store.validations()]
    # diloco: a round is due after CONVERGENCE_INNER_STEPS steps of `batch` per peer, so round r has seen about
    # r x H x batch x 2 samples, with the others' learning rate at the same samples seen. Overlapped rounds (the
    # default) and blocking ones, each with CONVERGENCE_SEEDS data orders (the peers' --seed): their curves are the
    # first seed's, and the verdict takes the mean over the seeds of the last validation by DDP's final samples.
    round_samples = CONVERGENCE_INNER_STEPS * batch * 2
    rounds = single["train_samples"] // round_samples
    seeds: dict[str, list[list]] = {}
    for name, overlap in (("diloco", "--overlap-rounds"), ("diloco-blocking", "--no-overlap-rounds")):
        for seed in range(1 if smoke else CONVERGENCE_SEEDS):
            label = f"conv-{name}-{seed}"
            run_swarm(work, label, 2, ["--validate-every", "1", "--threads", "1", "--refresh", "2", "--mode", "diloco",
                                       overlap, "--inner-steps", str(CONVERGENCE_INNER_STEPS),
                                       *diloco_schedule_flags(config, peers=2)], ["--seed", f"{10 * seed}{{index}}"],
                      timeout=900, until=lambda: validated_epoch(work / label / "metrics.sqlite") >= rounds)
            with MetricsReader(work / label / "metrics.sqlite") as store:
                seeds.setdefault(name, []).append([(row.epoch * round_samples, row.top1)
                                                   for row in store.validations()])
        curves[name] = seeds[name][0]
    # The same in groups: more peers, each still taking H steps per round, and the schedule stretched for them, so the
    # learning rate is again the others' at the same samples seen. The coordinator validates one peer's parameters.
    grouped_round_samples = CONVERGENCE_INNER_STEPS * batch * CONVERGENCE_GROUPED_PEERS
    grouped_rounds = max(1, single["train_samples"] // grouped_round_samples)
    run_swarm(work, "conv-diloco-grouped", CONVERGENCE_GROUPED_PEERS,
              ["--validate-every", "1", "--threads", "1", "--refresh", "2", "--mode", "diloco", "--overlap-rounds",
               "--inner-steps", str(CONVERGENCE_INNER_STEPS), "--target-group-size", str(CONVERGENCE_GROUP_SIZE),
               *diloco_schedule_flags(config, peers=CONVERGENCE_GROUPED_PEERS)], [],
              timeout=900,
              until=lambda: validated_epoch(work / "conv-diloco-grouped" / "metrics.sqlite") >= grouped_rounds)
    with MetricsReader(work / "conv-diloco-grouped" / "metrics.sqlite") as store:
        curves["diloco-grouped"] = [(row.epoch * grouped_round_samples, row.top1) for row in store.validations()]
    for name, curve in curves.items():
        print(f"{name}: final top-1 {curve[-1][1]:.3f} after {curve[-1][0]} samples", flush=True)
    return dict(preset="demo", global_batch_size=global_batch, curves=curves, inner_steps=CONVERGENCE_INNER_STEPS,
                seed_curves=seeds,
                grouped=dict(peers=CONVERGENCE_GROUPED_PEERS, target_group_size=CONVERGENCE_GROUP_SIZE),
                wall_time_s=dict(single=single["wall_time_s"], DDP=ddp["wall_time_s"]))


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


def join_suite(work: Path, smoke: bool) -> dict:
    """For the tiny preset and for ViT-B/32's full state: a coordinator and a seed peer that keeps training; peers
    join one after another. For each: seconds from its process start to "Joined the swarm" (state downloaded) and to
    its first local step. A smoke run: one joiner of the tiny preset."""
    imports = import_seconds(repeats=1 if smoke else 3)  # on the idle machine, before any role starts
    runs = [join_run(work, preset, 1 if smoke else joiners) for preset, joiners in (JOIN_RUNS[:1] if smoke else
                                                                                     JOIN_RUNS)]
    return dict(runs=runs, import_seconds=imports)


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
        results = []
        for index in range(joiners):
            joiner = start_peer(work, f"join-{preset}-joiner-{index}", addresses,
                                ["--threads", "1", "--max-steps", "3"])
            roles.append(joiner)
            loaded = joiner.wait_for_event("state_loaded", timeout=300)
            stepped = joiner.wait_for_event("first_step", timeout=300)
            joiner.popen.wait(300)
            results.append(dict(state_loaded_s=loaded["time"] - joiner.started,
                                first_step_s=stepped["time"] - joiner.started, epoch=loaded["epoch"]))
            print(f"{preset} joiner {index}: state loaded after {results[-1]['state_loaded_s']:.1f} s (epoch"
                  f" {results[-1]['epoch']}), first step after {results[-1]['first_step_s']:.1f} s", flush=True)
        return dict(preset=preset, model=get_preset(preset).model.name, joiners=results,
                    median_state_loaded_s=statistics.median(r["state_loaded_s"] for r in results),
                    median_first_step_s=statistics.median(r["first_step_s"] for r in results))
    finally:
        for role in reversed(roles):
            role.stop()


def _environment() -> dict:
    import hivemind
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return dict(date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), commit=commit,
                machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
                python=platform.python_version(), torch=torch.__version__, hivemind=hivemind.__version__)


def _join_section(result: dict, env: dict, out: Path) -> str:
    tables = ""
    for run in result["runs"]:
        rows = "".join(f"| {i} | {r['epoch']} | {r['state_loaded_s']:.1f} | {r['first_step_s']:.1f} |\n"
                       for i, r in enumerate(run["joiners"]))
        tables += (
            f"### `{run['preset']}` ({run['model']})\n\n"
            "| joiner | joined at epoch | state loaded (s) | first local step (s) |\n|---:|---:|---:|---:|\n"
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


def _swarm_row_label(r: dict) -> str:
    if r.get("mode", "sync") == "diloco":
        return f"swarm, diloco, {r['inner_steps']} inner steps per round"
    return (f"swarm, target batch {r['target_batch_size']} ({r['multiple']}x), state averaged every"
            f" {r['average_state_every']}")


def _throughput_section(result: dict, env: dict, out: Path) -> str:
    rows = "".join(
        f"| {_swarm_row_label(r)} | {r['samples_per_s']:.1f} | {r['ratio_to_ddp']:.2f} | {r['epochs']} in"
        f" {r['window_s']:.0f} s, {r['missed_rounds']} missed | {', '.join(f'{share:.0%}' for share in r['swarm_time_share'])}"
        f" | {r['training_cores']:.2f} | {r['background_cores']:.2f} |\n" for r in result["swarms"])
    single, ddp = result["single_samples_per_s"], result["ddp_samples_per_s"]
    sync = [r for r in result["swarms"] if r.get("mode", "sync") == "sync"]
    diloco = [r for r in result["swarms"] if r.get("mode") == "diloco"]
    best = max((r for r in sync if r["multiple"] >= 8), key=lambda r: r["ratio_to_ddp"],
               default=sync[0])  # a smoke run measures 4x only
    ddp_runs = " and ".join(f"{value:.1f}" for value in result["ddp_runs_samples_per_s"])
    diloco_verdict = "".join(
        " Target (diloco): at least 0.95x DDP. "
        + verdict(r["ratio_to_ddp"] >= 0.95, f"{r['ratio_to_ddp']:.2f}x DDP with {r['inner_steps']} inner steps per"
                   " round") for r in diloco)
    return (
        "## throughput\n\n"
        f"{measured_by(env)} The `{result['preset']}` preset, {result['batch_size']} samples per local"
        " step, on equal hardware: two processes with one torch thread each for DDP (gloo) and for the swarm's two"
        " peers (plus the coordinator, which only bootstraps and monitors here), one process with two threads for"
        " single. The swarm's samples/s are summed over its peers' own counts between the moment both trained and"
        " the first one's last swarm epoch (their epoch events); the baselines' come from their run records"
        " (training time, start-up excluded). DDP ran before and after the swarms"
        f" ({ddp_runs} samples/s); x DDP is against their mean. Time"
        " in swarm rounds: each peer's share of its training wall time spent in the steps that end a swarm epoch"
        " (sync: finding a group, gradient all-reduce, optimizer step, state averaging; diloco: the outer round) and"
        " in state downloads. Cores:"
        " CPU time per second over the same window, of the peers' training processes and of everything else the"
        " swarm runs (each peer's DHT, averager and p2pd processes; the coordinator and its own); the machine has"
        " two.\n\n"
        "| run | samples/s | x DDP | swarm epochs, missed rounds | time in swarm rounds (per peer) | training cores"
        " | background cores |\n"
        "|---|---:|---:|---|---|---:|---:|\n"
        f"| single, 2 threads | {single:.1f} | {single / ddp:.2f} | | | | |\n"
        f"| DDP, 2 x 1 thread | {ddp:.1f} | 1.00 | | | | |\n"
        f"{rows}\n"
        "Target (sync): a swarm at least 0.95x DDP from 8x the per-step batch on (plain hivemind 1.1.12 measured"
        " 0.46-0.58x at 256 and 0.79-0.84x at 1024 on this kind of machine). "
        + verdict(best["ratio_to_ddp"] >= 0.95, f"best: {best['ratio_to_ddp']:.2f}x DDP at target batch"
                   f" {best['target_batch_size']} ({best['multiple']}x), state averaged every"
                   f" {best['average_state_every']}") + diloco_verdict + "\n"
    )


def _links_section(result: dict, env: dict, out: Path) -> str:
    rows = "".join(
        f"| {r['rate_mbit']} Mbit/s | " + " | ".join(
            f"{r[kind]['samples_per_s']:.1f} | {r[kind]['bytes_per_sample'] / 1e3:.1f}" for kind in
            ("ddp", "sync", "diloco")) + " |\n" for r in result["results"])
    fastest = max(result["results"], key=lambda r: r["rate_mbit"])
    slowest = min(result["results"], key=lambda r: r["rate_mbit"])
    kept = slowest["diloco"]["samples_per_s"] / fastest["diloco"]["samples_per_s"]
    bytes_share = slowest["diloco"]["bytes_per_sample"] / slowest["ddp"]["bytes_per_sample"]
    return (
        "## links\n\n"
        f"{measured_by(env)} Two peers in network namespaces of their own, joined by one veth pair shaped"
        " in both directions with a token bucket (`tc ... tbf`) to each rate; the coordinator runs beside the first"
        f" peer. The `{result['preset']}` preset, {result['batch_size']} samples per local step, one torch thread per"
        " process: DDP with one process per namespace (gloo over the veth), the sync swarm at target batch"
        f" {8 * result['batch_size']}, and the diloco swarm with {result['inner_steps']} inner steps per round."
        " Samples/s: for the swarms, each peer's samples over its training time (from its first step to leaving,"
        " rounds and state downloads included), summed over the peers; for DDP, from its run record (training"
        " time). Bytes per sample: what crossed the link in both directions, over the samples trained; for the"
        " swarms from the moment both peers held the swarm's state to the last one's leaving, for DDP over the whole"
        " run (its start-up broadcast of the parameters included). Each swarm trains"
        f" {LINK_SWARM_SECONDS} s; the presets' matchmaking and averaging timeouts are used as they are.\n\n"
        "| link | DDP samples/s | DDP kB/sample | sync samples/s | sync kB/sample | diloco samples/s | diloco"
        " kB/sample |\n|---|---:|---:|---:|---:|---:|---:|\n"
        f"{rows}\n"
        f"Target: at {slowest['rate_mbit']} Mbit/s diloco keeps at least 0.9x its samples/s at"
        f" {fastest['rate_mbit']} Mbit/s, with bytes per trained sample at most 1% of DDP's. "
        + verdict(kept >= 0.9 and bytes_share <= 0.01, f"{kept:.2f}x, and {bytes_share:.1%} of DDP's bytes") + "\n"
    )


def _communication_section(result: dict, env: dict, out: Path) -> str:
    runs = result["results"]
    plain = next(r for r in runs if r["compression"] == "none")

    def mean_top1(run: dict) -> float:
        return sum(run["top1"]) / len(run["top1"])

    saved = {r["compression"]: 1 - r["bytes_per_sample"] / plain["bytes_per_sample"] for r in runs}
    cost = {r["compression"]: 100 * (mean_top1(plain) - mean_top1(r)) for r in runs}  # top-1 points lost
    rows = "".join(
        f"| {r['compression']} | {r['samples']} | {r['bytes'] / 1e6:.1f} | {r['bytes_per_sample'] / 1e3:.1f} |"
        f" {saved[r['compression']]:.0%} | {', '.join(f'{t:.3f}' for t in r['top1'])} |"
        f" {cost[r['compression']]:+.1f} |\n" for r in runs)
    return (
        "## communication\n\n"
        f"{measured_by(env)} For each compression (applied to gradient averaging, parameter and"
        f" state averaging and state downloads alike), a coordinator and two peers train the `{result['preset']}`"
        f" preset for {runs[0]['epochs']} swarm epochs. Bytes are Linux's counter of the loopback interface over the"
        " whole run (start-up, DHT, telemetry, the joiners' state downloads, leaving), divided by the samples the"
        " peers trained; top-1 is each peer's final weights on the whole validation split (360 digits: one digit is"
        " 0.28 points).\n\n"
        "| compression | samples | loopback MB | kB per sample | saved vs none | top-1 (each peer) | cost (points) |\n"
        "|---|---:|---:|---:|---:|---|---:|\n"
        f"{rows}\n"
        "Targets: at least 50% fewer bytes with fp16 and 70% with 8-bit, at a cost of at most 0.5 and 1 point (plain"
        " hivemind 1.1.12 with fp16 gradients only: 25% fewer). "
        + " ".join(verdict(saved[kind] >= least_saved and cost[kind] <= most_cost, kind)
                   for kind, (least_saved, most_cost) in COMPRESSION_TARGETS.items() if kind in saved) + "\n"
    )


# the curves validated by a coordinator, in table order
CONVERGENCE_SWARMS = ("swarm", "diloco", "diloco-blocking", "diloco-grouped")


def _convergence_section(result: dict, env: dict, out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = result["curves"]
    figure, axes = plt.subplots(figsize=(7, 4))
    for name, curve in curves.items():
        axes.plot([samples for samples, _ in curve], [top1 for _, top1 in curve],
                  marker="o" if name not in CONVERGENCE_SWARMS else None, label=name)
    axes.set(xlabel="samples seen", ylabel="validation top-1", title=f"{result['preset']}: convergence")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    plot = out / "benchmarks-convergence.png"
    figure.savefig(plot, dpi=100)
    plt.close(figure)

    def at(curve: list, samples: int) -> str:
        seen = [top1 for count, top1 in curve if count <= samples]
        return f"{seen[-1]:.3f}" if seen else ""

    swarms = [name for name in CONVERGENCE_SWARMS if name in curves]  # older records lack the later curves
    rows = "".join(f"| {samples} | {top1:.3f} | {at(curves['DDP'], samples)} | "
                   + " | ".join(at(curves[name], samples) for name in swarms) + " |\n"
                   for samples, top1 in curves["single"])
    diloco = ""
    if "diloco" in curves:
        final_samples, final_ddp = curves["DDP"][-1]
        reached = at(curves["diloco"], final_samples)
        gap = final_ddp - float(reached) if reached else None
        diloco = (f" diloco: 2 peers, {result['inner_steps']} inner steps of 32 per round; its schedule counts a"
                  " peer's inner steps, so warmup and total steps are the preset's times target batch / (2 x 32), the"
                  f" same learning rate at the same samples seen; round r is plotted at r x {result['inner_steps']} x 32"
                  " x 2 samples." + (" Its rounds overlap the next inner steps (`--overlap-rounds`), as do"
                                     " diloco-grouped's; diloco-blocking stops them for each round"
                                     " (`--no-overlap-rounds`)." if "diloco-blocking" in curves else ""))
        target = "\n\nTarget: diloco's top-1 within 1 point of DDP's at equal samples seen"
        if "seed_curves" in result:  # the mean over seeds, for overlapped and blocking rounds
            target += (f", as the mean of {len(result['seed_curves']['diloco'])} data orders (the peers' seeds)."
                        " Overlapped rounds become the default once they meet it.")
            for name, runs in result["seed_curves"].items():
                reached_runs = [at(curve, final_samples) for curve in runs]
                if not all(reached_runs):
                    target += f" {name}: **Not met** (a run was not validated by then)."
                    continue
                mean = sum(map(float, reached_runs)) / len(runs)
                what = (f"DDP {final_ddp:.3f}, {name} mean {mean:.3f} ({', '.join(reached_runs)}) at {final_samples}"
                        " samples")
                target += f" {name}: " + verdict(final_ddp - mean <= 0.01, what)
        else:
            what = f"DDP {final_ddp:.3f}, diloco {reached} at {final_samples} samples"
            target += ". " + (verdict(gap <= 0.01, what) if gap is not None
                               else "**Not met** (diloco was not validated by then).")
    else:
        target = ""
    if "diloco-grouped" in curves:
        grouped = result["grouped"]
        diloco += (f" diloco-grouped: the same with {grouped['peers']} peers averaging in groups of at most"
                   f" {grouped['target_group_size']} (`--target-group-size`), drawn anew each round, its schedule"
                   f" stretched by target batch / ({grouped['peers']} x 32); round r is plotted at r x"
                   f" {result['inner_steps']} x 32 x {grouped['peers']} samples, and the coordinator validates the"
                   " parameters of the one peer it downloads them from.")
    return (
        "## convergence\n\n"
        f"{measured_by(env)} The `{result['preset']}` preset from the same initial weights with the"
        f" same LR schedule and {result['global_batch_size']} samples per optimizer step: single (batch 32,"
        " accumulating 4), DDP (2 processes x 32, accumulating 2) and a swarm of 2 peers (target batch"
        f" {result['global_batch_size']}).{diloco} The baselines validate after each pass over the training data, the"
        " coordinator after each swarm epoch it sees; a swarm's column is its last validation at or before that"
        " many samples.\n\n"
        f"![Validation top-1 against samples seen]({plot.name})\n\n"
        f"| samples seen | single | DDP | {' | '.join(swarms)} |\n|---:|---:|---:|{'---:|' * len(swarms)}\n"
        f"{rows}\n"
        + "\n".join(f"Every validation of the {name} (samples seen: top-1): "
                    + ", ".join(f"{samples}: {top1:.3f}" for samples, top1 in curves[name]) + "." for name in swarms)
        + target + "\n"
    )


SUITES = {
    "join": (join_suite, _join_section),
    "throughput": (throughput_suite, _throughput_section),
    "links": (links_suite, _links_section),
    "communication": (communication_suite, _communication_section),
    "convergence": (convergence_suite, _convergence_section),
    "churn": (churn_suite, churn_section),
    "monitor": (monitor_suite, monitor_section),
    "attacks": (attacks_suite, attacks_section),
    "scale": (scale_suite, scale_page),
}
# the suites whose Markdown lands elsewhere than logbook/benchmarks.md: attacks beside the faults (tests/test_faults.py
# writes the rest of that page), scale a whole page of its own
PAGES = {"attacks": "reliability.md", "scale": "scale.md"}


def page_of(suite: str) -> Path:
    """The logbook page a suite's Markdown lands in: PAGES, or logbook/benchmarks.md."""
    return PAGE.parent / PAGES.get(suite, PAGE.name)


def write_section(name: str, section: str) -> None:
    """Write suite `name`'s Markdown into its page. A whole page (from a level-1 heading, "# ") replaces the page.
    A section ("## name") replaces that suite's section of the page (each section says which commit measured it);
    what comes before the first section and the other sections stay as they are."""
    page = page_of(name)
    if section.startswith("# "):
        page.write_text(section)
        return
    header = ("# Benchmarks\n\nEach section is written by `python -m benchmarks.bench SUITE` and says which commit,"
              " machine and versions measured it.\n\n")
    sections = {}
    if page.exists():
        header, *parts = re.split(r"(?m)^(?=## )", page.read_text())
        header = header.rstrip("\n") + "\n\n"
        for part in parts:
            sections[part.split("\n", 1)[0][3:].strip()] = part.rstrip("\n") + "\n\n"
    sections[name] = section.rstrip("\n") + "\n\n"
    page.write_text(header + "".join(sections[key] for key in sorted(sections)).rstrip("\n") + "\n")


def render(suite: str, record: dict, path: Path, out: Path) -> str:
    """Suite `suite`'s section or page from its record, kept at `path`; its plots are written into `out`. The renderer
    gets the record's environment with the command that measured it (records older than that field: the plain
    command) and the record's path."""
    env = dict(record["environment"], command=record.get("command", f"python -m benchmarks.bench {suite}"),
               record=_shown(path))
    return SUITES[suite][1](record["result"], env, out)


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def newest_record(suite: str) -> Path:
    records = sorted(RECORDS.glob(f"bench-{suite}-*.json"))
    if not records:
        raise SystemExit(f"no record of {suite} in {RECORDS}: run python -m benchmarks.bench {suite} first")
    return records[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("suite", choices=sorted(SUITES))
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--smoke", action="store_true",
                      help="the smallest run (for the tests): prints its record and Markdown, writes nothing")
    what.add_argument("--page", action="store_true",
                      help="measure nothing: the suite's section or page again from its newest record")
    args = parser.parse_args(argv)
    page = page_of(args.suite)
    if args.page:
        path = newest_record(args.suite)
        write_section(args.suite, render(args.suite, json.loads(path.read_text()), path, page.parent))
        print(f"Wrote {_shown(page)} ({args.suite}) from {_shown(path)}")
        return 0
    command = f"python -m benchmarks.bench {args.suite}" + (" --smoke" if args.smoke else "")
    env = _environment()
    work = Path(tempfile.mkdtemp(prefix=f"bench-{args.suite}-"))
    # on a failure the roles' logs stay in `work`: the error names them
    result = SUITES[args.suite][0](work, smoke=args.smoke)
    record = dict(suite=args.suite, command=command, environment=env, result=result)
    print(json.dumps(record, indent=1))
    if args.smoke:  # the record, the page and its plots go to the scratch folder, printed, then thrown away
        path = work / f"bench-{args.suite}-smoke.json"
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(render(args.suite, record, path, work))
        shutil.rmtree(work)
        return 0
    shutil.rmtree(work)
    RECORDS.mkdir(parents=True, exist_ok=True)
    path = RECORDS / f"bench-{args.suite}-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    write_section(args.suite, render(args.suite, record, path, page.parent))
    print(f"Wrote {_shown(page)} ({args.suite}) and {_shown(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
