"""The links suite: DDP and both swarm modes between two network namespaces over a veth shaped to 1 Gbit/s, 100 and
20 Mbit/s (python -m benchmarks.bench links)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks.harness import SMOKE_LOOKS, Process, reached_epoch, run_swarm
from benchmarks.report import measured_by, verdict
from benchmarks.throughput import THROUGHPUT_PRESET
from hivetrain.sampling import PeriodicSampler


LINK_RATES_MBIT = (1000, 100, 20)  # a data-centre link, a good home line, a volunteer's typical uplink

LINK_DDP_STEPS = {1000: 30, 100: 15, 20: 6}  # DDP steps of 2 x 32 samples: about a minute at each rate

LINK_INNER_STEPS = 100  # diloco: inner steps per round (about 1 s each here), as a GPU volunteer would take hundreds

LINK_SWARM_SECONDS = 240  # at least two rounds of each peer
SMOKE_SWARM_SECONDS = 12  # a smoke run's: some steps of each peer and bytes over the link, not a round's figures

LINK_RUNS = ("ddp", "sync", "diloco", "diloco-overlapped")  # diloco: blocking rounds; diloco-overlapped: overlapped


class LinkCounter(PeriodicSampler):
    """The bytes sent over a LinkedNamespaces link, sampled every half second while in a `with` block, and once more
    at its end: (time, bytes) pairs."""

    def __init__(self, network):
        super().__init__(0.5, "link-counter")
        self.network = network
        self.samples.append((time.time(), network.sent_bytes()))

    def sample(self) -> list[tuple[float, int]]:
        return [(time.time(), self.network.sent_bytes())]

    def __exit__(self, *exc) -> None:
        self.stop()
        self.samples.extend(self.sample())

    def between(self, start: float, end: float) -> int:
        """Bytes sent from the last sample at or before `start` to the first at or after `end` (a little wider)."""
        first = max((s for s in self.samples if s[0] <= start), default=self.samples[0])
        last = min((s for s in self.samples if s[0] >= end), default=self.samples[-1])
        return last[1] - first[1]


def links_ddp(work: Path, network, name: str, steps: int) -> dict:
    """DDP over the link: node 0 (one process) in namespace a, node 1 in b, gloo on the veth; its run result."""
    results = work / f"{name}-results"
    common = ["baselines/run.py", "--strategy", "ddp", "--num-nodes", "2", "--devices", "1", "--threads", "1",
              "--preset", THROUGHPUT_PRESET, "--batch-size", "32", "--epochs", "1000", "--max-steps", str(steps),
              "--val-limit", "0", "--progress-bar", "off", "--out-dir", str(work / name), "--result-dir",
              str(results)]
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
    [result] = results.glob("*.json")
    return json.loads(result.read_text())


def links_suite(work: Path, smoke: bool) -> dict:
    """Two peers in network namespaces of their own, joined by one veth pair shaped to 1 Gbit/s, 100 Mbit/s and
    20 Mbit/s (tbf): samples/s and bytes over the link per trained sample for DDP (gloo over the same link), the sync
    swarm (target batch 8x the per-step batch) and the diloco swarm, on the throughput suite's preset."""
    from benchmarks.netns import LinkedNamespaces

    unavailable = LinkedNamespaces.unavailable()
    if unavailable:
        raise RuntimeError(f"the links suite needs network namespaces: {unavailable}")
    batch, seconds = 32, SMOKE_SWARM_SECONDS if smoke else LINK_SWARM_SECONDS
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
            diloco = ["--mode", "diloco", "--inner-steps", str(inner_steps)]
            for mode, options in (("sync", ["--target-batch-size", str(8 * batch)]),
                                  ("diloco", [*diloco, "--no-overlap-rounds"]),
                                  ("diloco-overlapped", [*diloco, "--overlap-rounds"])):
                counter = LinkCounter(network)
                with counter:
                    _, peers = run_swarm(work, f"links-{rate}-{mode}", 2, [*options, *(SMOKE_LOOKS if smoke else [])],
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
                                                 for kind in LINK_RUNS), flush=True)
            results.append(row)
        finally:
            network.delete()
    return dict(preset=THROUGHPUT_PRESET, batch_size=batch, inner_steps=inner_steps, swarm_seconds=seconds,
                results=results)


def links_section(result: dict, env: dict, out: Path) -> str:
    # results from before the overlapped variant have no diloco-overlapped run: its columns stay empty there
    runs = [kind for kind in LINK_RUNS if any(kind in r for r in result["results"])]
    rows = "".join(
        f"| {r['rate_mbit']} Mbit/s | " + " | ".join(
            f"{r[kind]['samples_per_s']:.1f} | {r[kind]['bytes_per_sample'] / 1e3:.1f}" if kind in r else " | "
            for kind in runs) + " |\n" for r in result["results"])
    fastest = max(result["results"], key=lambda r: r["rate_mbit"])
    slowest = min(result["results"], key=lambda r: r["rate_mbit"])

    def kept(kind: str) -> float:
        return slowest[kind]["samples_per_s"] / fastest[kind]["samples_per_s"]

    bytes_share = slowest["diloco"]["bytes_per_sample"] / slowest["ddp"]["bytes_per_sample"]
    targets = [f"Target: at {slowest['rate_mbit']} Mbit/s diloco keeps at least 0.9x its samples/s at"
               f" {fastest['rate_mbit']} Mbit/s, with bytes per trained sample at most 1% of DDP's. "
               + verdict(kept("diloco") >= 0.9 and bytes_share <= 0.01,
                         f"{kept('diloco'):.2f}x, and {bytes_share:.1%} of DDP's bytes")]
    if "diloco-overlapped" in runs:
        targets.append(f"Target: at {slowest['rate_mbit']} Mbit/s diloco with overlapped rounds keeps at least 0.95x"
                       f" its own samples/s at {fastest['rate_mbit']} Mbit/s. "
                       + verdict(kept("diloco-overlapped") >= 0.95, f"{kept('diloco-overlapped'):.2f}x"))
    header = " | ".join(f"{kind if kind != 'ddp' else 'DDP'} samples/s | {kind if kind != 'ddp' else 'DDP'} kB/sample"
                        for kind in runs)
    return (
        "## links\n\n"
        f"{measured_by(env)} Two peers in network namespaces of their own, joined by one veth pair shaped"
        " in both directions with a token bucket (`tc ... tbf`) to each rate; the coordinator runs beside the first"
        f" peer. The `{result['preset']}` preset, {result['batch_size']} samples per local step, one torch thread per"
        " process: DDP with one process per namespace (gloo over the veth), the sync swarm at target batch"
        f" {8 * result['batch_size']}, and the diloco swarm with {result['inner_steps']} inner steps per round,"
        " its training stopped for each round (`--no-overlap-rounds`)"
        + (", and again with its rounds overlapped with the next inner steps (diloco-overlapped, `--overlap-rounds`)"
           if "diloco-overlapped" in runs else "") + "."
        " Samples/s: for the swarms, each peer's samples over its training time (from its first step to leaving,"
        " rounds and state downloads included), summed over the peers; for DDP, from its run result (training"
        " time). Bytes per sample: what crossed the link in both directions, over the samples trained; for the"
        " swarms from the moment both peers held the swarm's state to the last one's leaving, for DDP over the whole"
        " run (its start-up broadcast of the parameters included). Each swarm trains"
        f" {result.get('swarm_seconds', LINK_SWARM_SECONDS)} s; the presets' matchmaking and averaging timeouts are"
        " used as they are.\n\n"
        f"| link | {header} |\n|---|" + "---:|---:|" * len(runs) + "\n"
        f"{rows}\n" + "\n\n".join(targets) + "\n"
    )
