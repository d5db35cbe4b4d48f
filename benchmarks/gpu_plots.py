"""The GPU proof page's plots (benchmarks/gpu_page.py): training speed and memory per precision, and the GPUs'
utilisation and memory in use over the whole proof, from the result alone."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_speed(proof: dict, path: Path) -> bool:
    """Training samples/s and peak memory per precision, single GPU and DDP side by side; False when nothing ran."""
    measured = [(e["precision"], run) for e in proof["precisions"] for run in (e["single"], e.get("ddp"))
                if run is not None and not run.get("error")]
    if not measured:
        return False
    plt = _pyplot()
    fig, (speed_ax, memory_ax) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{precision}\n{run['strategy']} ×{run['devices']}\nbatch {run['batch_size']}"
              for precision, run in measured]
    speed_ax.bar(labels, [run["train_samples_per_s"] for _, run in measured], color="tab:blue")
    speed_ax.set_ylabel("training samples/s")
    speed_ax.set_title("Training speed")
    memory_ax.bar(labels, [max(run["peak_memory_bytes"]) / 2**30 for _, run in measured], color="tab:orange")
    total = measured[0][1]["total_memory_bytes"]
    if total:
        memory_ax.axhline(total / 2**30, color="black", linestyle="--", linewidth=1, label="GPU memory")
        memory_ax.legend(loc="lower right")
    memory_ax.set_ylabel("peak allocated (GiB)")
    memory_ax.set_title("Peak GPU memory (max over ranks)")
    fig.suptitle(f"ViT-B/32 at 224 px, {proof['data']['origin']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_utilisation(runs: list[tuple[str, dict]], path: Path) -> bool:
    """NVML utilisation and memory in use of each GPU over the whole proof, each run's span shaded and named; `runs`
    are (label, recording) of every run in the order they ran (gpu_page's `_runs`). False when nothing was sampled."""
    samples = [s for _, r in runs for s in r["nvml_series"]]
    if not samples:
        return False
    plt = _pyplot()
    fig, (util_ax, memory_ax) = plt.subplots(2, 1, figsize=(12, 6), sharex=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for n, gpu in enumerate(sorted({s["gpu"] for s in samples})):
        for i, (_, recording) in enumerate(runs):  # one line per run: nothing was sampled between runs
            mine = sorted((s for s in recording["nvml_series"] if s["gpu"] == gpu), key=lambda s: s["time_s"])
            times = [s["time_s"] for s in mine]
            style = dict(linewidth=1, color=colours[n % len(colours)], label=f"GPU {gpu}" if i == 0 else None)
            util_ax.plot(times, [s["util_percent"] for s in mine], **style)
            memory_ax.plot(times, [s["memory_used_bytes"] / 2**30 for s in mine], **style)
    for i, (label, recording) in enumerate(runs):
        start, end = recording["started_s"], recording["started_s"] + recording["seconds"]
        for ax in (util_ax, memory_ax):
            ax.axvspan(start, end, color="0.9" if i % 2 else "0.8", zorder=0)
        util_ax.text((start + end) / 2, 103, label.replace("`", ""), ha="center", va="bottom", fontsize=6,
                     rotation=30)
    util_ax.set_ylim(0, 100)
    util_ax.set_ylabel("GPU utilisation (%)")
    memory_ax.set_ylabel("memory in use (GiB)")
    memory_ax.set_xlabel("seconds since the proof started")
    util_ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
