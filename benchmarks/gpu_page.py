"""The GPU proof's page: logbook/gpu.md and its plots, rendered from one run's result (JSON) and nothing else.

    python -m benchmarks.gpu_page logbook/gpu-results/gpu-proof-20261125T120000.json [--out logbook]

`python -m benchmarks.gpu_proof` measures a run, writes its result and calls `render_gpu_page`; this command renders
the page again from a result (its raw nvidia-smi files are in the folder named by the result's `artifacts`, beside
it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from benchmarks.gpu_plots import plot_speed, plot_utilisation
from benchmarks.gpu_swarm import OWN_REFERENCE_RUN
from hivetrain.formatting import fmt_bytes, fmt_percent, fmt_seconds

PAGE_NAME = "gpu.md"
SPEED_PLOT = "gpu-speed.png"
UTILISATION_PLOT = "gpu-utilisation.png"


def render_gpu_page(proof: dict, out_dir: Path, results_dir: Path) -> Path:
    """Write `out_dir`/gpu.md and its plots from `proof`, the proof's result (as gpu_proof writes it, read from
    `results_dir`, where its artifacts folder is); returns the page's path. A result marked `example` says so at the
    top of the page."""
    out_dir.mkdir(parents=True, exist_ok=True)
    artifacts = results_dir / proof["artifacts"]
    def link(path: Path, text: Optional[str] = None) -> str:
        """A link relative to the page; with `text`, the markdown link, or the text marked "not kept" where the file is
        missing (raw files that did not come back from the GPU machine: the result keeps what they showed)."""
        relative = os.path.relpath(path, out_dir)
        return relative if text is None else f"[{text}]({relative})" if path.exists() else f"{text} (not kept)"
    env, data = proof["environment"], proof["data"]
    gpus = env["gpus"]
    gpu_text = ", ".join(f"{g['name']} ({fmt_bytes(g['memory_total_bytes'])})" for g in gpus) or "none seen by NVML"
    title_gpu = gpus[0]["name"] if gpus else "a CUDA GPU"
    lines = [f"# GPU proof: ViT-B/32 on {title_gpu}", ""]
    if proof.get("example"):
        lines += ["> **Example result, not a measurement.** This page was rendered from a hand-written example result"
                  " (a test fixture); none of its numbers were measured.", ""]
    if not proof.get("finished", True):
        lines += ["> **Cut off.** The proof stopped before its last step (a time limit or a lost machine); the page"
                  " shows the steps it finished, saved after each one.", ""]
    lines += [
        f"Measured by `{proof['command']}` on {env['date']}, commit `{env['commit']}` ({env['host']}; {env['cpu']}).",
        f"GPUs: {gpu_text}; NVIDIA driver {env.get('driver') or 'unknown'}; {env['cuda_device_count']} visible to CUDA."
        f" Python {env['python']}, torch {env['torch']} (CUDA {env['cuda']}, cuDNN {env['cudnn']}),"
        f" hivemind {env.get('hivemind') or 'not installed'}. The whole proof took"
        f" {fmt_seconds(proof['wall_time_s'])}.",
        "",
        f"**Data: {data['origin']}.** uint8 images of {'×'.join(map(str, data['image_shape']))} with labels of"
        f" {data['num_classes']} classes, {data['train_samples']:,} for training and {data['val_samples']:,} for"
        f" validation, seed {data['seed']}, made on the fly by DataLoader workers and resized to"
        f" {proof['model']['img_size']} px and normalised on the GPU. They are noise: accuracy means nothing here"
        " (validation top-1 stays at chance, about 10%); speed and memory are those of the real model.",
        "",
        f"**Model:** timm `{proof['model']['name']}`, random init, {proof['model']['num_classes']} classes,"
        f" at {proof['model']['img_size']} px, with the `{proof['model']['optimizer_preset']}` preset's AdamW;"
        " plain PyTorch training steps (autocast for mixed precision, a gradient scaler for 16-mixed), no"
        " torch.compile" + (" but in the compiled run at the swarm's batch." if "compiled" in proof else "."),
        "",
    ]
    lines += _batch_section(proof)
    lines += _speed_section(proof, out_dir)
    lines += _reference_section(proof, artifacts, link)
    lines += _control_section(proof, artifacts, link)
    lines += _swarm_section(proof, artifacts, link)
    lines += _recording_section(proof, out_dir, artifacts, link)
    result_file = results_dir / f"{proof['name']}.json"
    lines += ["## The result", "",
              f"Everything above comes from [{result_file.name}]({link(result_file)}) and the raw files beside it;"
              f" `python -m benchmarks.gpu_page {result_file} --out {out_dir}` renders this page again from it.", ""]
    page = out_dir / PAGE_NAME
    page.write_text("\n".join(lines).rstrip("\n") + "\n")
    return page


def _failure(error: str) -> str:
    """A step's error as the page shows it: a step skipped or never reached says so; anything else failed."""
    return error if error.startswith(("skipped", "not ", "failed")) else f"failed: {error}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return out + ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]


def _batch_section(proof: dict) -> list[str]:
    settings = proof["settings"]
    if settings.get("search") is False:  # --no-search: one line instead of a table of skipped searches
        return ["## The largest batch per precision", "",
                f"Not searched (`--no-search`): every precision ran at the swarm's batch, {settings['swarm_batch']}.",
                ""]
    rows, details = [], []
    for entry in proof["precisions"]:
        search = entry["search"]
        if search.get("error"):
            rows.append([f"`{entry['precision']}`", "–", "–", "–", "–", _failure(search["error"])])
            continue
        trials = search["trials"]
        best = next((t for t in trials if t["fits"] and t["batch_size"] == search["batch_size"]), None)
        note = f"the finder's cap ({search['cap']}): a larger batch may fit" if search["batch_size"] >= search["cap"] \
            else f"{min(t['batch_size'] for t in trials if not t['fits'])} did not fit"
        rows.append([f"`{entry['precision']}`", str(search["batch_size"]), fmt_bytes(best and best["peak_bytes"]),
                     str(len(trials)), fmt_seconds(sum(t["seconds"] for t in trials)), note])
        steps = ", ".join(f"{t['batch_size']} {'fits' if t['fits'] else 'no: ' + t['reason']}"
                          + (f" ({fmt_bytes(t['peak_bytes'])})" if t["peak_bytes"] else "") for t in trials)
        details.append(f"- `{entry['precision']}`: {steps}")
    return [
        "## The largest batch per precision", "",
        *_table(["precision", "largest batch", "peak memory (that trial)", "trials", "search time",
                 "smallest that failed"], rows),
        "",
        "Found against the GPU's real memory by the project's batch finder (`baselines/batch_finder.py`, the search of"
        " `--batch-size auto`): each trial is its own process that builds the model and optimizer and takes 3"
        " training steps on one batch; a batch fits when CUDA does not run out of memory. The search doubles from"
        f" {settings['search_start']} (or from the previous precision's answer, when larger) until a trial fails, then"
        f" bisects until the gap is within {settings['search_tolerance']:g} of the answer. Peak memory is"
        " `torch.cuda.max_memory_allocated`. Trials in order:",
        "",
        *details,
        "",
    ]


def _speed_section(proof: dict, out_dir: Path) -> list[str]:
    rows = []
    for entry in proof["precisions"]:
        for run in (entry["single"], entry.get("ddp")):
            if run is None:
                continue
            if run.get("error"):
                # The error says itself whether the run failed or was never started.
                rows.append([f"`{entry['precision']}`", run.get("strategy", "?"), *["–"] * 6, run["error"]])
                continue
            peak = max(run["peak_memory_bytes"])
            share = fmt_percent(100 * peak / run["total_memory_bytes"]) if run["total_memory_bytes"] else "–"
            retries = [a["batch_size"] for a in run.get("attempts", []) if a["out_of_memory"]]
            note = f"out of memory at {', '.join(map(str, retries))}: smaller batch" if retries else ""
            rows.append([f"`{entry['precision']}`", f"{run['strategy']} ({run['devices']} GPU)",
                         str(run["batch_size"]), f"{run['train_samples_per_s']:,.0f}",
                         f"{run['val_samples_per_s']:,.0f}" if run["val_samples_per_s"] else "–",
                         fmt_bytes(peak), share, f"{run['steps']} in {run['train_seconds']:.1f} s", note])
    lines = [
        "## Speed and memory at that batch", "",
        *_table(["precision", "run", "batch per GPU", "train samples/s", "validation samples/s",
                 "peak GPU memory", "of the GPU", "timed steps", "note"], rows),
        "",
        f"Training is timed after warm-up ({proof['settings']['warmup_steps']} steps) for at least"
        f" {proof['settings']['speed_seconds']:g} s (whole steps, the GPU synchronised at both ends), then one pass"
        " over the validation split. Peak memory is `torch.cuda.max_memory_allocated` since the process started"
        " (model, optimizer state, activations), the largest over the ranks. Data: "
        f"{proof['data']['origin']}.",
        "",
        proof["ddp_note"],
        "",
    ]
    if plot_speed(proof, out_dir / SPEED_PLOT):
        lines += [f"![Training samples/s and peak GPU memory per precision]({SPEED_PLOT})", ""]
    return lines


def _percent(share: Optional[float]) -> str:
    return "–" if share is None else f"{100 * share:.1f}%"


def _shares(shares: Optional[list]) -> str:
    return ", ".join(_percent(share) for share in shares) if shares else "–"


def _met(met: Optional[bool]) -> str:
    return "–" if met is None else ("met" if met else "not met")


def _reference_section(proof: dict, artifacts: Path, link) -> list[str]:
    """The single process and the pure-compute ceiling at the swarm's batch (results from before they were measured
    have no `reference`: nothing is shown)."""
    reference = proof.get("reference")
    if not reference:
        return []
    single, ceiling = reference.get("single"), reference.get("ceiling")
    lines = [f"## One process at the swarm's batch ({reference['batch_size']}, `{reference['precision']}`)", ""]
    if single is None:
        lines.append("- With the project's loader: not reached: the proof stopped before it.")
    elif single.get("error"):
        lines.append(f"- With the project's loader: {_failure(single['error'])}.")
    else:
        batch_note = "" if single["batch_size"] == reference["batch_size"] else \
            f" (at batch {single['batch_size']}: {reference['batch_size']} ran out of memory)"
        lines.append(f"- With the project's loader (`benchmarks.gpu_speed`, {reference['single_from']}):"
                     f" **{single['train_samples_per_s']:,.0f} training samples/s**{batch_note}; the swarm below is"
                     " held against this.")
    if ceiling is None:
        lines.append("- Pure-compute ceiling: not reached: the proof stopped before it.")
    elif ceiling.get("error"):
        lines.append(f"- Pure-compute ceiling: {_failure(ceiling['error'])}.")
    else:
        lines.append(
            f"- Pure-compute ceiling (`benchmarks.gpu_ceiling`: one batch of images already on the GPU, no loader, no"
            f" swarm): **{ceiling['samples_per_s']:,.0f} samples/s**, MFU **{_percent(ceiling['mfu'])}** of the"
            f" card's bf16 matrix rate measured in the same run, {ceiling['bf16_matmul_flops'] / 1e12:,.0f} TFLOP/s"
            f" ({ceiling['matmul_size']}³ product); {ceiling['train_flops_per_image'] / 1e9:,.1f} GFLOP per training"
            f" image (3 × the forward's, counted by torch)."
            f" Log: {link(artifacts / ceiling['log'], ceiling['log'])}.")
    if "compiled" in proof:
        lines.append(_compiled_line(proof["compiled"], artifacts, link))
    return lines + [""]


def _compiled_line(compiled: Optional[dict], artifacts: Path, link) -> str:
    """The single process with torch.compile against the eager one, as a line of the reference's list."""
    what = "With torch.compile (`benchmarks.gpu_speed --compile`, default mode, no validation pass)"
    if compiled is None:
        return f"- {what}: not reached: the proof stopped before it."
    log = f" Log: {link(artifacts / compiled['log'], compiled['log'])}." if compiled.get("log") else ""
    if compiled.get("error"):
        return f"- {what}: {_failure(compiled['error'])}.{log}"
    ratio = compiled["ratio_to_eager"]
    against = ("no ratio: the eager process was not measured at this batch" if ratio is None else
               f"**{ratio:.3f}×** the eager process's {compiled['eager_samples_per_s']:,.0f}, target ≥"
               f" {compiled['ratio_target']:g}: {_met(compiled['ratio_target_met'])}")
    return (f"- {what}: **{compiled['train_samples_per_s']:,.0f} training samples/s** at batch"
            f" {compiled['batch_size']} ({compiled['steps']} steps in {compiled['train_seconds']:.1f} s), {against}."
            f" Compilation happens in the first of {compiled['warmup_steps']} untimed warm-up steps, which took"
            f" {compiled['first_step_seconds']:.1f} s ({compiled['warmup_seconds']:.1f} s in all).{log}")


def _utc(seconds: float) -> str:
    """A time.time() value as the page shows a wall-clock time: UTC to the millisecond."""
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%H:%M:%S.%f")[:-3]


def _control_section(proof: dict, artifacts: Path, link) -> list[str]:
    """Two plain processes sharing the GPU, the swarm's control (results from before it have no `control`: nothing is
    shown)."""
    if "control" not in proof:
        return []
    control = proof["control"]
    lines = ["## Two plain processes sharing the GPU (the swarm's control)", ""]
    if control is None:
        return lines + ["Not reached: the proof stopped before it.", ""]
    logs = _logs_lines([control], artifacts, link)
    if control.get("error"):
        return lines + [f"Not measured: {_failure(control['error'])}.", "", *logs]
    ratio = control["ratio_to_single"]
    rows = [[str(n), str(run["seed"]), f"{run['train_samples_per_s']:,.0f}",
             f"{_utc(run['window_start_time'])}–{_utc(run['window_end_time'])}",
             f"{run['steps']} in {run['train_seconds']:.1f} s", f"{run['ready_wait_seconds']:.1f} s"
             + (" (gave up waiting: timed alone)" if run["ready_timed_out"] else ""),
             fmt_bytes(max(run["peak_memory_bytes"]))] for n, run in enumerate(control["runs"])]
    rows.append(["both", "", f"**{control['samples_per_s']:,.0f}**",
                 f"overlap {control['overlap_s']:.2f} s ({100 * control['overlap_share']:.0f}% of the longer)", "",
                 "", ""])
    lines += [
        f"Two plain `python -m benchmarks.gpu_speed` processes at batch {control['batch_size']} in"
        f" `{control['precision']}` on the same GPU at once, with no swarm: **{control['samples_per_s']:,.0f} training"
        " samples/s together, "
        + (f"{ratio:.3f} of one process's** ({control['single_samples_per_s']:,.0f} samples/s, above)." if ratio
           is not None else "** (no ratio: the single process was not measured).")
        + " The swarm's two peers share the GPU in the same way: what these two lose against one process is the cost"
        " of two processes time-slicing one GPU, and the swarm's *of two plain processes'* below is what the swarm"
        " costs on top of it.",
        "",
    ]
    if not control["overlapped"]:
        lines += [f"> **Their timed windows did not overlap enough** ({100 * control['overlap_share']:.0f}% of the"
                  f" longer, under {100 * control['overlap_min_share']:.0f}%): part of each window ran without the"
                  " other, so the sum is not that of two processes sharing the GPU.", ""]
    util, warmup_steps = control["gpu_util_percent"], control["runs"][0]["warmup_steps"]
    lines += [
        *_table(["process", "seed", "train samples/s", "timed window (UTC)", "timed steps", "waited for the other",
                 "peak GPU memory"], rows),
        "",
        f"Each process took {warmup_steps} untimed warm-up step{'' if warmup_steps == 1 else 's'}, then waited until"
        " both were ready (`--ready-dir`), and both started timing at the same wall-clock moment, for at least"
        f" {control['seconds']:g} s each (whole steps), with no validation pass. GPU utilisation (NVML) over the"
        " windows' overlap: " + ("–" if util is None else fmt_percent(util) + (
            "" if control["gpu_util_over"] == "window" else " (no sample inside it: over the whole run)")) + ".",
        "",
    ]
    return lines + logs


def _swarm_section(proof: dict, artifacts: Path, link) -> list[str]:
    swarm = proof["swarm"]
    lines = ["## The swarm on the GPU", ""]
    if swarm.get("skipped"):
        return lines + [f"Not run: {swarm['skipped']}", ""]
    if "variants" not in swarm:  # a result from before the mission-shaped swarm: sync and diloco on digits
        return lines + _modes_section(swarm, artifacts, link)
    rows = []
    for run in swarm["variants"]:
        if run.get("error"):
            rows.append([run["variant"], str(run.get("peers", 2)), *["–"] * 10, _failure(run["error"])])
            continue
        ratio, to_control = run["ratio_to_single"], run.get("ratio_to_control")  # older results: no control
        rows.append([run["variant"], str(run.get("peers", 2)), f"{run['samples_per_s']:,.0f}",
                     "–" if ratio is None else f"{ratio:.3f}",
                     "–" if to_control is None else f"{to_control:.3f}",
                     _met(run["ratio_target_met"]), _met(run["ratio_stretch_met"]),
                     "–" if run["gpu_util_percent"] is None else fmt_percent(run["gpu_util_percent"]),
                     _shares(run["swarm_time_share"]), _shares(run["wait_share"]), _percent(run["mfu"]),
                     f"{fmt_seconds(run['window_s'])}, {run['epochs']}", ""
                     if run["gpu_util_over"] == "window" else "GPU utilisation over the whole run"])
    single = (proof.get("reference") or {}).get("single") or {}
    single_rate = (f"{single['train_samples_per_s']:,.0f} samples/s, above" if single.get("train_samples_per_s")
                   else "not measured: no ratio")
    control = proof.get("control") or {}
    control_rate = (f"{control['samples_per_s']:,.0f} samples/s, above" if control.get("samples_per_s")
                    else "not measured: no ratio")
    lines += [
        *_table(["variant", "peers", "samples/s (all peers)", "of one process's", "of two plain processes'",
                 f"≥ {swarm['ratio_target']:g}",
                 f"≥ {swarm['ratio_stretch']:g}", "GPU utilisation", "time in swarm rounds (per peer)",
                 "waiting for overlapped rounds (per peer)", "MFU", "window, rounds", "note"], rows),
        "",
        f"A coordinator of the `{swarm['preset']}` preset ({swarm['preset_note']}) in diloco mode,"
        f" {swarm['inner_steps']} inner steps a round, and peers at batch {swarm['batch_size']} in"
        f" `{swarm['precision']}` on loopback: two sharing the same GPU, or one alone on it (a volunteer's own card:"
        " its rounds have nobody to average with, so what it loses against one plain process is what the peer"
        " itself costs). Per variant, the coordinator ran "
        + "; ".join(f"{variant}: `{command}`" for variant, command in swarm["coordinator_commands"].items())
        + "; each peer `" + swarm["peer_command"] + "`.",
        "",
        "Samples/s adds the peers' rates, read from their epoch events (`--events`, one per round) while all"
        f" trained; *of one process's* divides it by the single process's at the same batch"
        f" ({single_rate}), against the target"
        f" {swarm['ratio_target']:g} and the stretch {swarm['ratio_stretch']:g}; *of two plain processes'* divides it"
        f" by the control's, two plain processes sharing the GPU ({control_rate}; two peers only). GPU utilisation is"
        " NVML's mean over the samples taken while all peers trained (the window). Each peer's shares of its training time come from"
        " its leaving event: stood still for swarm rounds and state downloads (`swarm_seconds`), and waiting for an"
        " overlapped round to finish (`wait_seconds`). MFU: samples/s × the ceiling's training FLOPs per image over"
        " the card's measured bf16 matrix rate.",
        "",
    ]
    return lines + _logs_lines(swarm["variants"], artifacts, link)


def _modes_section(swarm: dict, artifacts: Path, link) -> list[str]:
    """The swarm of an older result: one row per swarm mode (sync, diloco) of the digits-vit-b32 preset."""
    rows = []
    for run in swarm["modes"]:
        if run.get("error"):
            rows.append([run["mode"], "–", "–", "–", "–", "–", _failure(run["error"])])
            continue
        shares = ", ".join(f"{100 * s:.0f}%" for s in run["swarm_time_share"])
        rows.append([run["mode"], f"{run['samples_per_s']:,.0f}", fmt_seconds(run["window_s"]), str(run["epochs"]),
                     shares, str(run["missed_rounds"]), ""])
    lines = [
        *_table(["swarm mode", "samples/s (both peers)", "window", "swarm epochs", "time in swarm rounds (per peer)",
                 "missed rounds", "note"], rows),
        "",
        f"A coordinator and two peers of the `{swarm['preset']}` preset ({swarm['preset_note']}) on loopback, both"
        " peers on the same GPU: `" + swarm["coordinator_command"] + "` and, per peer, `" + swarm["peer_command"]
        + "`. Samples/s adds both peers' rates, read from their epoch events (`--events`)"
        " while both trained.",
        "",
    ]
    return lines + _logs_lines(swarm["modes"], artifacts, link)


def _logs_lines(runs: list[dict], artifacts: Path, link) -> list[str]:
    """A line linking the roles' logs of every swarm run, when any were kept."""
    logs = [name for run in runs for name in run.get("logs", [])]
    return ["Logs: " + ", ".join(f"{link(artifacts / name, name)}" for name in logs) + ".", ""] if logs else []


def _runs(proof: dict) -> list[tuple[str, dict]]:
    """(label, recording) of every run, in the order they ran."""
    runs = []
    for entry in proof["precisions"]:
        runs.append((f"batch search `{entry['precision']}`", entry["search"].get("recording")))
        for run in (entry["single"], entry.get("ddp")):
            if run is not None:
                runs.append((f"speed `{entry['precision']}` {run.get('strategy', '')}", run.get("recording")))
    reference = proof.get("reference") or {}
    if reference.get("single_from") == OWN_REFERENCE_RUN:
        runs.append((f"speed `{reference['precision']}` at the swarm's batch", reference["single"].get("recording")))
    if reference.get("ceiling"):
        runs.append((f"ceiling `{reference['precision']}`", reference["ceiling"].get("recording")))
    if proof.get("control"):
        runs.append(("two plain processes (control)", proof["control"].get("recording")))
    for run in proof["swarm"].get("variants", proof["swarm"].get("modes", [])):
        runs.append((f"swarm {run.get('variant') or run['mode']}", run.get("recording")))
    if proof.get("compiled"):
        runs.append((f"speed `{reference.get('precision', '')}` compiled", proof["compiled"].get("recording")))
    return [(label, recording) for label, recording in runs if recording]


def _recording_section(proof: dict, out_dir: Path, artifacts: Path, link) -> list[str]:
    rows = []
    for label, recording in _runs(proof):
        series = recording["nvml_series"]
        util = [s["util_percent"] for s in series]
        memory = [s["memory_used_bytes"] for s in series]
        files = [*recording.get("nvidia_smi_dumps", []), *([recording["nvidia_smi_csv"]]
                                                            if recording.get("nvidia_smi_csv") else [])]
        rows.append([label, f"{recording['started_s']:.0f}–{recording['started_s'] + recording['seconds']:.0f} s",
                     fmt_percent(sum(util) / len(util)) if util else "–", fmt_percent(max(util)) if util else "–",
                     fmt_bytes(max(memory)) if memory else "–",
                     ", ".join(f"{link(artifacts / name, name.split('.', 1)[1])}" for name in files) or "–"])
    errors = sorted({r["nvml_error"] for _, r in _runs(proof) if r.get("nvml_error")})
    lines = [
        "## What the GPUs did", "",
        *_table(["run", "when (since start)", "mean GPU utilisation", "max GPU utilisation", "max memory in use",
                 "raw nvidia-smi"], rows),
        "",
        "Utilisation and memory in use of every GPU, from NVML every second (memory in use counts every process's"
        " CUDA context and cache, so it exceeds the peak allocated above). For each run: `nvidia-smi`'s CSV log"
        " every second; for speed and swarm runs, the raw `nvidia-smi` and `nvidia-smi -q -d MEMORY,UTILIZATION`"
        " text taken while the run held the GPU.",
        "",
    ]
    if errors:
        lines += [f"NVML problems: {'; '.join(errors)}.", ""]
    if proof.get("start_dumps"):
        lines += ["Before the first run: " + ", ".join(f"{link(artifacts / name, name)}"
                                                       for name in proof["start_dumps"]) + ".", ""]
    if plot_utilisation(_runs(proof), out_dir / UTILISATION_PLOT):
        lines += [f"![GPU utilisation and memory in use over the whole proof]({UTILISATION_PLOT})", ""]
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_page", description=__doc__.split("\n\n")[0])
    parser.add_argument("result", type=Path, help="a JSON result written by python -m benchmarks.gpu_proof")
    parser.add_argument("--out", type=Path, default=Path("logbook"), help="where gpu.md and its plots go")
    args = parser.parse_args(argv)
    try:
        proof = json.loads(args.result.read_text())
        page = render_gpu_page(proof, args.out, args.result.parent)
    except (OSError, ValueError) as e:
        print(f"error: {args.result}: {e}", file=sys.stderr)
        return 2
    except (KeyError, TypeError) as e:
        print(f"error: {args.result}: not a GPU proof result (missing or mistyped field {e})", file=sys.stderr)
        return 2
    print(f"Wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
