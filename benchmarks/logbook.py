"""The logbook: Markdown pages with tables and plots rendered from run results.

    python -m benchmarks.logbook build [--results logbook/results ...] [--out logbook] [--experiment demo]

Every result (one JSON file per run, see hivetrain.run_result) belongs to an experiment (by default its preset). Each
experiment gets `<out>/<experiment>-baselines.md`: a side-by-side table of single / DP / DDP / FSDP / pipeline /
swarm, a
table per strategy, validation loss and top-1 against wall time and utilisation against time as PNG files next to
the page, the commands that produced every result, and the TensorBoard command. A malformed result stops the build
with the file and the field named.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Optional

from hivetrain.formatting import fmt_bytes, fmt_pct, fmt_percent, fmt_seconds
from hivetrain.run_result import STRATEGIES, RunResult, read_result

STRATEGY_TITLES = {"single": "Single device", "dp": "DataParallel", "ddp": "DDP", "fsdp": "FSDP",
                   "pipeline": "Pipeline", "swarm": "Swarm"}
PAGE_SUFFIX = "-baselines"  # logbook/<preset>.md is the swarm demo's own page (scripts/demo.py)


@dataclass
class Loaded:
    result: RunResult
    path: Path


def load_results(directories: list[Path]) -> list[Loaded]:
    loaded = []
    for directory in directories:
        if not directory.is_dir():
            raise ValueError(f"--results {directory}: no such directory")
        for path in sorted(directory.glob("*.json")):
            loaded.append(Loaded(read_result(path), path))  # raises ValueError naming file and field
    names: dict[str, Path] = {}
    for item in loaded:
        if item.result.name in names:
            raise ValueError(f"{item.path}: result name {item.result.name!r} also in {names[item.result.name]}")
        names[item.result.name] = item.path
    return loaded


# --- measures --------------------------------------------------------------------------------------------------


def cpu_mean(r: RunResult) -> Optional[float]:
    """Mean CPU % of the training processes (100 = one core), over all ranks' samples."""
    values = [s.cpu_percent for s in r.utilisation]
    return mean(values) if values else None


def gpu_mean(r: RunResult) -> Optional[float]:
    values = [s.gpu_util_percent for s in r.utilisation if s.gpu_util_percent is not None]
    return mean(values) if values else None


def other_load(r: RunResult) -> Optional[float]:
    """CPU cores busy with other programs while the run trained (the machine's CPU minus our processes'), averaged
    over the seconds where every rank sampled: a shared machine makes speed numbers noisy, and this shows how much.
    Only for runs whose ranks share one machine."""
    if r.cpu_count is None or len({m.host for m in r.memory}) != 1:
        return None
    by_second: dict[int, list] = defaultdict(list)
    for s in r.utilisation:
        by_second[round(s.time_s)].append(s)
    ours = max if r.strategy == "dp" else sum  # DataParallel: one process sampled once per GPU
    others = [max(0.0, mean(s.system_cpu_percent for s in group) / 100 * r.cpu_count
                  - ours(s.cpu_percent for s in group) / 100)
              for group in by_second.values() if len({s.rank for s in group}) == r.world_size]
    return mean(others) if others else None


def layout(r: RunResult) -> str:
    if r.strategy == "swarm":
        return f"{r.world_size} peers"
    if r.strategy == "dp":
        return f"1 process × {r.devices_per_node} GPUs"
    n = r.devices_per_node
    unit = ("GPU" + "s" * (n > 1)) if r.accelerator == "cuda" else ("CPU process" + "es" * (n > 1))
    stages = f"{r.world_size} stages ({r.pipeline.schedule}, {r.pipeline.microbatches} micro-batches) on " \
        if r.pipeline else ""
    return f"{stages}{r.num_nodes} node{'s' * (r.num_nodes > 1)} × {n} {unit}"


def batch_text(r: RunResult) -> str:
    return f"{r.batch_size}{' (auto)' if r.batch_size_auto else ''}"


def stage_memory(r: RunResult) -> str:
    """Each pipeline stage's peak memory (GPU allocated on GPUs, else RSS); '–' for other strategies."""
    if r.pipeline is None:
        return "–"
    return ", ".join(f"stage {m.rank}: {fmt_bytes(m.peak_rss_bytes if m.peak_gpu_bytes is None else m.peak_gpu_bytes)}"
                     for m in r.memory)


def parameters_held(r: RunResult) -> str:
    if r.sharding is None:
        return "all"
    held = r.sharding.per_rank_param_bytes
    each = ", ".join(fmt_bytes(b) for b in held) if r.pipeline else fmt_bytes(max(held))  # stages differ, shards not
    return f"{each} of {fmt_bytes(r.sharding.total_param_bytes)}"


def checkpoint_text(r: RunResult) -> str:
    return f"`{r.best_checkpoint}`" if r.best_checkpoint else "–"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return lines


# --- the page --------------------------------------------------------------------------------------------------


def side_by_side(results: list[RunResult]) -> list[str]:
    """The latest result of each strategy, one column each; the swarm column says so when there is no result."""
    latest: dict[str, RunResult] = {}
    for r in sorted(results, key=lambda r: r.started_at):
        latest[r.strategy] = r
    columns = [s for s in STRATEGIES if s in latest or s in ("single", "ddp", "fsdp", "swarm")]
    missing = "no result yet"

    def row(label: str, value) -> list[str]:
        return [label] + [value(latest[s]) if s in latest else missing for s in columns]

    rows = [
        row("run", lambda r: f"`{r.name}`"),
        row("layout", layout),
        row("precision", lambda r: r.precision),
        row("batch per device (max found)", batch_text),
        row("global batch (× accumulate)", lambda r: f"{r.global_batch_size} (× {r.accumulate})"),
        row("epochs / optimizer steps", lambda r: f"{r.epochs} / {r.steps}"),
        row("final val top-1", lambda r: fmt_pct(r.final.top1) if r.final else "–"),
        row("final val top-5", lambda r: fmt_pct(r.final.top5) if r.final else "–"),
        row("final val loss", lambda r: f"{r.final.loss:.4f}" if r.final else "–"),
        row("best val top-1", lambda r: fmt_pct(r.best_top1)),
        row("training time (wall, incl. validation)", lambda r: fmt_seconds(r.wall_time_s)),
        row("throughput", lambda r: f"{r.samples_per_s:.1f} samples/s"),
        row("peak RSS per rank (max)", lambda r: fmt_bytes(r.peak_rss_bytes)),
        row("peak GPU memory per rank (max)", lambda r: fmt_bytes(r.peak_gpu_bytes)),
        row("peak memory per pipeline stage (GPU, or RSS on CPUs)", stage_memory),
        row("CPU per process (mean, 100% = 1 core)", lambda r: fmt_percent(cpu_mean(r))),
        row("GPU utilisation (mean)", lambda r: fmt_percent(gpu_mean(r))),
        row("other programs' CPU meanwhile (mean)", lambda r: f"{other_load(r):.2f} cores" if other_load(r) is not None
            else "–"),
        row("parameters held per rank", parameters_held),
        row("best checkpoint", checkpoint_text),
    ]
    lines = _table([""] + [STRATEGY_TITLES[s] for s in columns], rows)
    if "swarm" not in latest:
        lines += ["", "No swarm result for this experiment yet: the swarm column fills in once a swarm run writes a"
                      " result (hivetrain.run_result) into the results folder."]
    return lines


def strategy_section(strategy: str, items: list[Loaded], out: Path) -> list[str]:
    lines = [f"## {STRATEGY_TITLES[strategy]}", ""]
    rows = []
    for item in items:
        r = item.result
        cpu, gpu = cpu_mean(r), gpu_mean(r)
        rows.append([
            f"[`{r.name}`]({os.path.relpath(item.path, out)})", layout(r), r.precision, batch_text(r),
            f"{r.global_batch_size}", f"{r.epochs} / {r.steps}",
            f"{r.final.loss:.4f}" if r.final else "–", fmt_pct(r.final.top1) if r.final else "–",
            fmt_pct(r.final.top5) if r.final else "–", fmt_seconds(r.wall_time_s), f"{r.samples_per_s:.1f}",
            fmt_bytes(r.peak_rss_bytes), fmt_bytes(r.peak_gpu_bytes),
            fmt_percent(cpu), fmt_percent(gpu), checkpoint_text(r),
        ])
    lines += _table(["run", "layout", "precision", "batch/device", "global batch", "epochs / steps", "val loss",
                     "top-1", "top-5", "wall time", "samples/s", "peak RSS/rank", "peak GPU/rank", "CPU/process",
                     "GPU util", "best checkpoint"], rows)
    for item in items:
        r = item.result
        lines += ["", f"`{r.name}`: validation per epoch", ""]
        if r.validation:
            lines += _table(["epoch", "step", "wall time", "loss", "top-1", "top-5"], [
                [str(v.epoch), str(v.step), fmt_seconds(v.time_s), f"{v.loss:.4f}", fmt_pct(v.top1), fmt_pct(v.top5)]
                for v in r.validation])
        else:
            lines.append("No validation ran (--val-limit 0, or training stopped before an epoch ended).")
        ranks = [f"rank {m.rank} {fmt_bytes(m.peak_rss_bytes)} RSS"
                 + (f" / {fmt_bytes(m.peak_gpu_bytes)} GPU" if m.peak_gpu_bytes is not None else "") for m in r.memory]
        lines += ["", "Peak memory per rank: " + ", ".join(ranks) + "."]
        if r.pipeline and r.sharding:
            lines.append(f"Pipeline stages ({r.pipeline.schedule} schedule, {r.pipeline.microbatches} micro-batches per"
                         " batch): " + "; ".join(
                             f"stage {i} runs {what} ({fmt_bytes(b)} of parameters)" for i, (what, b) in
                             enumerate(zip(r.pipeline.stages, r.sharding.per_rank_param_bytes, strict=True)))
                         + f", of {fmt_bytes(r.sharding.total_param_bytes)}.")
        elif r.sharding:
            s = r.sharding
            lines.append(f"FSDP shards: each rank holds {', '.join(fmt_bytes(b) for b in s.per_rank_param_bytes)} of"
                         f" {fmt_bytes(s.total_param_bytes)} of parameters (largest shard {s.max_fraction:.1%} of the"
                         f" model; 1/{len(s.per_rank_param_bytes)} = {1 / len(s.per_rank_param_bytes):.1%}).")
        if r.batch_search:
            b = r.batch_search
            budget = f"a budget of {fmt_bytes(b.budget_bytes)}" if b.budget_bytes else "CUDA out-of-memory errors"
            trials = ", ".join(f"{t.batch_size} {'fits' if t.fits else '✗'}" for t in b.trials)
            lines.append(f"Batch search against {budget} (cap {b.cap}): {trials}." if b.trials else
                         f"Batch {r.batch_size} found by the node's batch search against {budget}.")
        if r.notes:
            lines.append(f"Notes: {r.notes}")
        if r.nvidia_smi_log:
            lines.append(f"Raw GPU log: `{r.nvidia_smi_log}`.")
    return lines + [""]


def plot_metrics(results: list[RunResult], path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_val = [r for r in results if r.validation]
    if not with_val:
        return False
    fig, (loss_ax, top1_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for r in with_val:
        label = f"{r.strategy}: {r.name}"
        t = [v.time_s for v in r.validation]
        loss_ax.plot(t, [v.loss for v in r.validation], marker="o", markersize=3, label=label)
        top1_ax.plot(t, [100 * v.top1 for v in r.validation], marker="o", markersize=3, label=label)
    loss_ax.set(xlabel="wall time since training started (s)", ylabel="validation loss", title="Validation loss")
    top1_ax.set(xlabel="wall time since training started (s)", ylabel="top-1 (%)", title="Validation top-1")
    for ax in (loss_ax, top1_ax):
        ax.grid(alpha=0.3)
    top1_ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_utilisation(results: list[RunResult], path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sampled = [r for r in results if r.utilisation]
    if not sampled:
        return False
    with_gpu = any(s.gpu_util_percent is not None for r in sampled for s in r.utilisation)
    fig, axes = plt.subplots(1, 3 if with_gpu else 2, figsize=(16 if with_gpu else 11, 4))
    for r in sampled:
        label = f"{r.strategy}: {r.name}"
        # Ranks sample on their own clocks about once a second: group by the nearest second, then average ranks.
        by_second: dict[int, list] = defaultdict(list)
        for s in r.utilisation:
            by_second[round(s.time_s)].append(s)
        seconds = sorted(by_second)
        process = [mean(s.cpu_percent for s in by_second[t]) for t in seconds]
        machine = [mean(s.system_cpu_percent for s in by_second[t]) for t in seconds]
        axes[0].plot(seconds, process, marker=".", label=label)
        axes[1].plot(seconds, machine, marker=".", label=label)
        if with_gpu:
            axes[2].plot(seconds, [mean([s.gpu_util_percent for s in by_second[t] if s.gpu_util_percent is not None]
                                        or [0.0]) for t in seconds], marker=".", label=label)
    axes[0].set(xlabel="time since training started (s)", ylabel="CPU % (100 = one core)",
                title="CPU per training process (mean over ranks)")
    axes[1].set(xlabel="time since training started (s)", ylabel="CPU % (100 = all cores)", title="Whole machine CPU",
                ylim=(0, 105))
    if with_gpu:
        axes[2].set(xlabel="time since training started (s)", ylabel="GPU utilisation %",
                    title="GPU utilisation (mean over ranks)", ylim=(0, 105))
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def tensorboard_line(results: list[RunResult]) -> Optional[str]:
    dirs = [r.tensorboard_dir for r in results if r.tensorboard_dir]
    if not dirs:
        return None
    # All runs of an experiment log under <out-dir>/tensorboard/<experiment>/<run>: their common parent shows them all.
    try:
        common = os.path.commonpath(dirs) if len(dirs) > 1 else str(Path(dirs[0]).parent)
    except ValueError:  # absolute and relative paths mixed (results from different machines): name each run
        spec = ",".join(f"{r.name}:{r.tensorboard_dir}" for r in results if r.tensorboard_dir)
        return f"tensorboard --logdir_spec {shlex.quote(spec)}"
    return f"tensorboard --logdir {shlex.quote(common)}"


def render_page(experiment: str, items: list[Loaded], out: Path, build_command: str) -> str:
    results = [i.result for i in items]
    stem = f"{experiment}{PAGE_SUFFIX}"
    presets = sorted({(r.preset, r.fingerprint) for r in results})
    hardware = sorted({f"{r.device_name} on {r.host}" for r in results})
    versions = sorted({", ".join(f"{k} {v}" for k, v in r.versions.items()) for r in results})
    lines = [
        f"# {experiment}: baselines and swarm",
        "",
        f"Built by `{build_command}` from {len(results)} run result{'s' if len(results) != 1 else ''}"
        f" ({', '.join(sorted({os.path.relpath(i.path.parent, out) + '/' for i in items}))}, one JSON file per run).",
        "Preset " + ", ".join(f"`{p}` (fingerprint `{f}`)" for p, f in presets) + ". Hardware: "
        + "; ".join(hardware) + ". Software: " + "; ".join(versions) + ".",
        "",
        "## Side by side",
        "",
        "The latest run of each strategy on this experiment.",
        "",
        *side_by_side(results),
        "",
    ]
    metrics_png, util_png = out / f"{stem}-metrics.png", out / f"{stem}-utilisation.png"
    plots = []
    if plot_metrics(results, metrics_png):
        plots.append(f"![Validation loss and top-1 against wall time]({metrics_png.name})")
    if plot_utilisation(results, util_png):
        plots.append(f"![CPU and GPU utilisation against time]({util_png.name})")
    if plots:
        lines += ["## Plots", ""] + [p for plot in plots for p in (plot, "")]
    by_strategy: dict[str, list[Loaded]] = defaultdict(list)
    for item in sorted(items, key=lambda i: i.result.started_at):
        by_strategy[item.result.strategy].append(item)
    for strategy in STRATEGIES:
        if strategy in by_strategy:
            lines += strategy_section(strategy, by_strategy[strategy], out)
    lines += ["## How these results were made", "", "Each result's exact command (run from the repository root):", "",
              "```bash"]
    lines += [i.result.command for i in sorted(items, key=lambda i: i.result.started_at)]
    lines += ["```", "", "Then this page:", "", "```bash", build_command, "```", ""]
    board = tensorboard_line(results)
    if board:
        lines += ["Training curves (loss per step, validation per epoch) in TensorBoard, on the machine that ran them:",
                  "", "```bash", board, "```", ""]
    return "\n".join(lines)


def build(result_dirs: list[Path], out: Path, experiment: Optional[str], build_command: str) -> list[Path]:
    items = load_results(result_dirs)
    if experiment is not None:
        items = [i for i in items if i.result.experiment == experiment]
    if not items:
        where = ", ".join(str(d) for d in result_dirs)
        raise ValueError(f"no run results{f' of experiment {experiment!r}' if experiment else ''} in {where}")
    groups: dict[str, list[Loaded]] = defaultdict(list)
    for item in items:
        groups[item.result.experiment].append(item)
    out.mkdir(parents=True, exist_ok=True)
    pages = []
    for name, group in sorted(groups.items()):
        page = out / f"{name}{PAGE_SUFFIX}.md"
        page.write_text(render_page(name, group, out, build_command))
        pages.append(page)
    return pages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.logbook",
        description="Render logbook pages (Markdown + PNG plots) from run results.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="render <out>/<experiment>-baselines.md for every experiment in the results",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    b.add_argument("--results", nargs="+", default=["logbook/results"], metavar="DIR",
                   help="folders of run results (*.json)")
    b.add_argument("--out", default="logbook", help="where pages and plots are written")
    b.add_argument("--experiment", default=None, help="only this experiment (default: every one found)")
    args = parser.parse_args(argv)
    words = ["--results", *args.results, "--out", args.out]
    words += ["--experiment", args.experiment] if args.experiment else []
    command = "python -m benchmarks.logbook build " + shlex.join(words)
    try:
        pages = build([Path(d) for d in args.results], Path(args.out), args.experiment, command)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for page in pages:
        print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
