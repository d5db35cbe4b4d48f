"""The communication suite: loopback bytes per sample and accuracy with no compression, fp16 and 8-bit
(python -m benchmarks.bench communication)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.harness import SMOKE_LOOKS, evaluate_weights, run_swarm
from benchmarks.report import measured_by, verdict


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
        _, peers = run_swarm(work, f"comm-{kind}", 2, ["--grad-compression", kind, "--state-compression", kind,
                                                       *(SMOKE_LOOKS if smoke else [])],
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


def communication_section(result: dict, env: dict, out: Path) -> str:
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
