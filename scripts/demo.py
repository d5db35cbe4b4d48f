"""The embedded default: a coordinator and two volunteer peers on this machine train the `demo` preset (a tiny ViT on
scikit-learn's digits) in diloco rounds. The coordinator validates the shared model as it trains and keeps the best
checkpoint; the run is written to runs/demo/logbook/demo.md from its metrics store (with --publish, `make logbook`: to
logbook/).

    python scripts/demo.py [--mode diloco|sync] [--round-seconds 2 | --inner-steps H] [--epochs N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's tools are not installed

from benchmarks.harness import (ROOT, Process, git_commit, run_baseline, start_coordinator, start_peer,
                                wait_until_marked_left, wait_until_validated)
from hivetrain.config import (MAX_ROUND_SECONDS, MIN_ROUND_SECONDS, SWARM_MODES, RunConfig, diloco_schedule_flags,
                              get_preset)
from hivetrain.sampling import PeriodicSampler

# Rounds paced in seconds, as a GPU swarm runs them: every peer's round falls due on one grid of the clock, so its
# group is looked for ahead and stands ready, and the all-reduce runs beside the next inner steps. Rounds paced in
# inner steps (--inner-steps) fall due when the progress records say so, which each peer reads at its own moment:
# the group forms only once the later one has noticed, and rounds of 16 steps here spent 19-22% of the peers' time
# waiting for it (32 steps: 19%), against 7-10% paced every 2 s (`python scripts/demo.py [--inner-steps 32]`).
DEMO_ROUND_SECONDS = 2.0
DEMO_PACED_ROUNDS = 6
# Overlapped rounds run beside the next H inner steps (about a second of this tiny model's compute): a round's
# matchmaking window must end well within them, or each peer waits for it. Peers on one machine find each other at once.
DEMO_MATCHMAKING_SECONDS = 0.5
DDP_REFERENCE_STEPS = 100  # DDP's samples/s on the same cores at the peers' per-step batch, the swarm's reference
OUR_LINES = re.compile(r"^(Run |To join|  python|Only loopback|Metrics|Joined run|Batch:|Starting at|swarm epoch|"
                       r"validation at|best checkpoint|Leaving|Saved|Left|error)")


def _show(name: str):
    """Echo the lines meant for people, prefixed with who said them; the full output stays in the role's log."""
    def show(line: str) -> None:
        if OUR_LINES.match(line):
            print(f"[{name}] {line}", end="", flush=True)
    return show


class PeerSampler(PeriodicSampler):
    """CPU % and resident memory of each peer (its process and the hivemind processes it started), every second."""

    def __init__(self, pids: list[int], interval: float = 1.0):
        super().__init__(interval, "peer-sampler")
        import psutil

        self.psutil, self.pids = psutil, pids
        self.peak_rss = [0] * len(pids)
        self._tracked: dict[int, object] = {}
        self._t0 = time.monotonic()

    def _tree(self, pid: int) -> list:
        try:
            root = self.psutil.Process(pid)
            processes = [root, *root.children(recursive=True)]
        except self.psutil.NoSuchProcess:
            return []
        # keep one Process object per pid: cpu_percent measures since that object's previous call
        return [self._tracked.setdefault(p.pid, p) for p in processes]

    def before_first(self) -> bool:
        self.psutil.cpu_percent(None)  # the first call only sets the reference point
        return True

    def sample(self) -> list:
        from hivetrain.run_result import UtilisationSample

        system, samples = self.psutil.cpu_percent(None), []
        for rank, pid in enumerate(self.pids):
            cpu = rss = 0
            for process in self._tree(pid):
                try:
                    cpu += process.cpu_percent(None)
                    rss += process.memory_info().rss
                except self.psutil.NoSuchProcess:
                    continue
            if rss:
                self.peak_rss[rank] = max(self.peak_rss[rank], rss)
                samples.append(UtilisationSample(
                    time_s=round(time.monotonic() - self._t0, 2), rank=rank, cpu_percent=round(cpu, 1),
                    system_cpu_percent=system, rss_bytes=rss,
                ))
        return samples


def _free_port(preferred: int) -> int:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", preferred))
        except OSError:
            sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_dashboard(workdir: Path, preferred_port: int) -> Process:
    """The dashboard on the demo's metrics store; it shows "waiting for the coordinator" until the store exists."""
    from hivetrain.roles.dashboard.launch import streamlit_command

    port = _free_port(preferred_port)
    dashboard = Process(streamlit_command(workdir / "metrics.sqlite", "127.0.0.1", port)[1:], workdir / "dashboard.log")
    print(f"Dashboard: http://127.0.0.1:{port} (live peers, validation curve, checkpoints)", flush=True)
    return dashboard


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python scripts/demo.py")
    parser.add_argument("--mode", choices=SWARM_MODES, default="diloco",
                        help="diloco (default): outer rounds, each overlapped with the next round's inner steps"
                             " (--overlap-rounds); sync: the preset as it is, gradients averaged every swarm epoch of"
                             " 128 samples")
    parser.add_argument("--round-seconds", type=float, default=DEMO_ROUND_SECONDS, metavar="S",
                        help="diloco: a round every S seconds of the clock, each peer taking the inner steps it fits"
                             " (default: %(default)s); the preset's schedule is stretched to the inner steps the"
                             " peers can take in --epochs rounds at the DDP reference's speed")
    parser.add_argument("--inner-steps", type=int, default=None, metavar="H",
                        help="diloco: a round every H local steps of 32 samples per peer instead, the preset's"
                             " schedule stretched to the same learning rate per sample seen")
    parser.add_argument("--epochs", type=int, default=None,
                        help=f"swarm epochs to train: outer rounds (diloco) or optimizer steps (sync); default:"
                             f" {DEMO_PACED_ROUNDS} rounds paced in seconds, else the samples of the preset's schedule"
                             f" (60 x 128)")
    parser.add_argument("--workdir", default=str(ROOT / "runs" / "demo"), help="where logs and weights go")
    parser.add_argument("--logbook", default=None,
                        help="the page written at the end (default: <workdir>/logbook/demo.md; with --publish,"
                             " logbook/demo.md)")
    parser.add_argument("--dashboard-port", type=int, default=8501,
                        help="where the dashboard serves on 127.0.0.1 (default: %(default)s; a free one when busy)")
    parser.add_argument("--result-dir", default=None,
                        help="where the swarm's run result goes ('' for none; default: <workdir>/results; with"
                             " --publish, logbook/results); the demo's baselines page is rebuilt beside its page from"
                             " that folder and the committed baseline results in logbook/results")
    parser.add_argument("--publish", action="store_true",
                        help="write the page and the run result into the repository's logbook/ (make logbook): the"
                             " committed logbook changes only when asked")
    args = parser.parse_args(argv)
    if (args.inner_steps is not None and args.inner_steps < 1) or (args.epochs is not None and args.epochs < 1):
        parser.error("--inner-steps and --epochs must be at least 1")
    if args.inner_steps is None and not MIN_ROUND_SECONDS <= args.round_seconds <= MAX_ROUND_SECONDS:
        parser.error(f"--round-seconds must be from {MIN_ROUND_SECONDS:g} to {MAX_ROUND_SECONDS:g}")
    paced = args.mode == "diloco" and args.inner_steps is None
    preset = get_preset("demo")
    if paced:
        args.epochs = args.epochs or DEMO_PACED_ROUNDS
    else:
        args.inner_steps = args.inner_steps or 16
        schedule_samples = preset.optim.total_steps * preset.swarm.target_batch_size
        epoch_samples = (args.inner_steps * preset.batch_size * 2 if args.mode == "diloco"
                         else preset.swarm.target_batch_size)
        args.epochs = args.epochs or -(-schedule_samples // epoch_samples)
    logbook = ROOT / "logbook" if args.publish else Path(args.workdir) / "logbook"
    args.logbook = args.logbook or str(logbook / "demo.md")
    if args.result_dir is None:
        args.result_dir = str(logbook / "results")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    for previous in ("metrics.sqlite", "metrics.sqlite-wal", "metrics.sqlite-shm", "checkpoints", "tensorboard"):
        path = workdir / previous  # each demo is a run of its own: its best checkpoint must beat nothing older
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    print(f"DDP on this machine for reference (2 processes, one thread each, {preset.batch_size} samples per step"
          f" each, as the peers)...", flush=True)
    try:  # its run result stays in the workdir (the logbook's baselines come from `baselines/run.py` runs)
        ddp = run_baseline(workdir, "ddp-reference", [
            "--strategy", "ddp", "--devices", "2", "--threads", "1", "--batch-size", str(preset.batch_size),
            "--epochs", "1000", "--max-steps", str(DDP_REFERENCE_STEPS), "--val-limit", "0"])["samples_per_s"]
    except RuntimeError as e:
        print(f"error: the DDP reference run failed: {e}", file=sys.stderr)
        return 1

    swarm_options = (["--mode", "diloco", "--overlap-rounds", "--matchmaking-time", str(DEMO_MATCHMAKING_SECONDS),
                      *(["--round-seconds", f"{args.round_seconds:g}",
                         *paced_schedule_flags(preset, args.epochs * args.round_seconds, ddp)] if paced else
                        ["--inner-steps", str(args.inner_steps), *diloco_schedule_flags(preset, 2)])]
                     if args.mode == "diloco" else ["--mode", "sync"])
    rounds = ("swarm epochs" if args.mode == "sync" else f"rounds paced every {args.round_seconds:g} s" if paced
              else f"rounds of {args.inner_steps} inner steps")
    print(f"HiveTrain demo: a coordinator and two peers on 127.0.0.1 train for {args.epochs} {rounds}"
          f" ({args.mode} mode). Full logs: {workdir}/", flush=True)
    roles: list[Process] = [_start_dashboard(workdir, args.dashboard_port)]
    peers: list[Process] = []
    try:
        try:
            coordinator, address = start_coordinator(workdir, "coordinator", ["--refresh", "2", *swarm_options],
                                                     log_dir=workdir, echo=_show("coordinator"))
        except RuntimeError as e:
            print(f"error: the coordinator did not start: {e}", file=sys.stderr)
            return 1
        roles.append(coordinator)
        started, started_unix = time.monotonic(), time.time()
        started_at = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        for i in (1, 2):
            peers.append(start_peer(workdir, f"peer{i}", address, [
                "--host", "127.0.0.1", "--threads", "1", "--min-peers", "2", "--stop-at-epoch", str(args.epochs),
                "--save-weights", str(workdir / f"peer{i}.safetensors")], echo=_show(f"peer{i}")))
        roles += peers
        sampler = PeerSampler([peer.popen.pid for peer in peers])
        sampler.start()
        codes = [peer.wait(timeout=None) for peer in peers]
        wall_time = time.monotonic() - started
        sampler.stop()
        # the figures read from the store afterwards are the peers' last: the monitor has read their goodbyes
        wait_until_marked_left(workdir / "metrics.sqlite", ["peer1", "peer2"], timeout=30)
        # the last peers left once the coordinator held their state, which it validates meanwhile: the page shows it
        handed = [event["epoch"] for peer in peers for event in peer.events("hand_over") if event["held"]]
        if handed and not wait_until_validated(workdir / "metrics.sqlite", max(handed), timeout=60):
            print(f"The coordinator did not validate the swarm's last state (epoch {max(handed)}) within 60 s: the"
                  f" figures below stop at its validation before", flush=True)
    except KeyboardInterrupt:
        print("Stopping the demo.", flush=True)
        return 130
    finally:
        for role in reversed(roles):
            role.stop()
    if any(codes):
        print(f"error: a peer failed (exit codes {codes}); see {workdir}/peer*.log", file=sys.stderr)
        return 1
    losses = [event["loss"] for event in peers[0].events("epoch") if event["loss"] is not None]
    result = _measure(workdir, args.mode, None if paced else args.inner_steps, wall_time, losses, started_unix)
    result["round_seconds"] = args.round_seconds if paced else None
    result["ddp_samples_per_s"] = ddp
    (workdir / "result.json").write_text(json.dumps(result, indent=2))
    _write_logbook(Path(args.logbook), result)
    if args.result_dir:
        result_path = _write_run_result(Path(args.result_dir), workdir, result, sampler, started_at,
                                        " ".join(["python", *sys.argv]))
        from benchmarks.logbook import build

        # The committed baselines of the preset beside this run (the same folder when publishing).
        folders = list(dict.fromkeys([ROOT / "logbook" / "results", Path(args.result_dir).resolve()]))
        results, out = " ".join(_shown(folder) for folder in folders), _shown(Path(args.logbook).parent)
        pages = build(folders, Path(args.logbook).parent, "demo",
                      f"python -m benchmarks.logbook build --results {results} --out {out}")
        print(f"Swarm run result: {result_path}; logbook pages: {', '.join(map(str, pages))}", flush=True)
    best = result["best"]
    print(f"\nBest validation on {best['samples']} held-out digits: top-1 {best['top1']:.1%}, top-5"
          f" {best['top5']:.1%}, loss {best['loss']:.3f} at swarm epoch {best['epoch']} (checkpoint"
          f" {result['best_checkpoint']}); {result['swarm_epochs']} swarm epochs ({result['mode']}) in"
          f" {result['wall_time_s']:.0f} s ({result['samples_per_s']:.0f} samples/s, {result['swarm_time_share']:.0%} of"
          f" the peers' time in swarm rounds; while training {result['training_samples_per_s']:.0f} samples/s"
          f" against DDP's {ddp:.0f}); the two peers' weights differ by"
          f" at most {result['max_weight_difference']:.2e}.\nWritten to {args.logbook} and {workdir}/result.json",
          flush=True)
    return 0


def paced_schedule_flags(config: RunConfig, training_seconds: float, ddp_samples_per_s: float) -> list[str]:
    """Coordinator flags for rounds paced in seconds: the preset's warmup and total steps stretched to the inner steps
    one of two peers takes in `training_seconds` at the DDP reference's speed (2 processes, its samples/s), and never
    fewer than the samples of the preset's schedule need (diloco_schedule_flags). A schedule that ends early would
    leave the last rounds at a learning rate of nothing; one that ends late, as this does when the peers train slower
    than DDP, ends the run before its last decay."""
    preset_flags = diloco_schedule_flags(config, 2)
    stretched_total = int(preset_flags[3])
    total = max(stretched_total, round(training_seconds * ddp_samples_per_s / (2 * config.batch_size)))
    warmup = round(int(preset_flags[1]) * total / stretched_total)
    return ["--warmup-steps", str(warmup), "--total-steps", str(total)]


def _measure(workdir: Path, mode: str, inner_steps: Optional[int], wall_time: float, losses: list[float],
             started_unix: float) -> dict:
    """The run's figures from the coordinator's metrics store and the peers' saved weights; `losses`: peer1's mean
    training loss of each swarm epoch (its events)."""
    import torch

    from hivetrain.metrics_store import MetricsReader
    from hivetrain.model import create_model, load_weights

    with MetricsReader(workdir / "metrics.sqlite") as store:
        config = RunConfig.from_json(store.run().config_json)  # the preset as the coordinator ran it
        validations = [dict(epoch=v.epoch, time_s=round(v.time - started_unix, 1), top1=v.top1, top5=v.top5,
                            loss=v.loss, samples=v.samples) for v in store.validations()]
        best = next((c for c in store.checkpoints() if c.best), None)
        peers = store.peers()
    models, epochs_reached = [], []
    for i in (1, 2):
        model = create_model(config.model, seed=config.seed)
        epochs_reached.append(int(load_weights(workdir / f"peer{i}.safetensors", model)["epoch"]))
        models.append(model)
    difference = max((a - b).abs().max().item() for a, b in zip(models[0].parameters(), models[1].parameters()))
    contributions = {p.name: p.samples for p in peers}
    # each peer's share of its training time spent in swarm rounds and state downloads (its last record)
    shares = [p.swarm_seconds / p.train_seconds for p in peers if p.train_seconds and p.swarm_seconds is not None]
    if not validations or best is None:
        raise RuntimeError(f"the coordinator recorded no validation; see {workdir}/coordinator.log")
    best_validation = max(validations, key=lambda v: v["top1"])  # the first of the best, as the store picks it
    swarm_epochs = min(epochs_reached)
    return dict(
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), commit=git_commit(),
        machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, no GPU",
        versions=_versions(),
        preset="demo", fingerprint=config.fingerprint, peers=2, threads_per_peer=1, mode=mode,
        inner_steps=inner_steps if mode == "diloco" else None, config=config.to_dict(),
        # samples per swarm epoch: the target batch (sync); in diloco what the peers trained per round, on average:
        # a round falls due at H steps of both peers by the progress records, which a peer reads at most every 0.5 s,
        # so a round of less than that holds more (RoundTracker.update_epoch)
        epoch_samples=(round(sum(contributions.values()) / max(1, swarm_epochs)) if mode == "diloco"
                       else config.swarm.target_batch_size),
        target_batch_size=config.swarm.target_batch_size, batch_size=config.batch_size,
        swarm_epochs=swarm_epochs, wall_time_s=round(wall_time, 1), train_samples=sum(contributions.values()),
        samples_per_s=round(sum(contributions.values()) / wall_time, 1),
        # as DDP's is measured: over training time, start-up and state download excluded (each peer's, summed)
        training_samples_per_s=round(sum(p.samples / p.train_seconds for p in peers if p.train_seconds), 1),
        swarm_time_share=round(sum(shares) / len(shares), 3) if shares else None,
        first_loss=losses[0] if losses else None, last_loss=losses[-1] if losses else None,
        validations=validations, best=best_validation, best_checkpoint=_shown(Path(best.uri)),
        contributions=contributions, max_weight_difference=difference, torch_threads=torch.get_num_threads(),
    )


def _shown(path: Path) -> str:
    """A path as the logbook shows it: relative to the repository when it lies inside."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _write_run_result(result_dir: Path, workdir: Path, r: dict, sampler: PeerSampler, started_at: str,
                      command: str) -> Path:
    """The demo as a run result of strategy "swarm", so the logbook sets it beside single, DDP and FSDP."""
    from hivetrain.run_result import RankMemory, RunResult, ValidationPoint, cpu_name, software_versions, write_result

    config = RunConfig.from_dict(r["config"])
    samples, epoch_samples = r["train_samples"], r["epoch_samples"]
    passes = samples // 1437  # digits' training split
    return write_result(RunResult(
        name=f"demo-swarm-{r['peers']}peers-{started_at.replace(':', '').replace('-', '')[:15]}",
        experiment="demo", strategy="swarm", preset="demo", config=config.to_dict(), fingerprint=config.fingerprint,
        command=command, started_at=started_at, host=os.uname().nodename, accelerator="cpu", device_name=cpu_name(),
        versions=software_versions(), num_nodes=1, devices_per_node=r["peers"], world_size=r["peers"],
        threads=r["threads_per_peer"], precision="32", batch_size=r["batch_size"], batch_size_auto=False,
        # samples per swarm epoch: accumulated over steps (sync), or a round of H inner steps per peer (diloco)
        accumulate=epoch_samples // (r["batch_size"] * r["peers"]), global_batch_size=epoch_samples,
        epochs=passes, steps=r["swarm_epochs"], train_samples=samples, wall_time_s=r["wall_time_s"],
        train_time_s=r["wall_time_s"], samples_per_s=r["samples_per_s"],
        # the coordinator validates the shared model as the swarm trains (its metrics store)
        validation=[ValidationPoint(epoch=v["epoch"] * epoch_samples // 1437, step=v["epoch"],
                                    time_s=v["time_s"], loss=round(v["loss"], 6), top1=round(v["top1"], 6),
                                    top5=round(v["top5"], 6)) for v in r["validations"]],
        memory=[RankMemory(rank=rank, host=os.uname().nodename, peak_rss_bytes=peak)
                for rank, peak in enumerate(sampler.peak_rss)],
        utilisation=sampler.samples, best_checkpoint=r["best_checkpoint"],
        best_top1=round(r["best"]["top1"], 6), cpu_count=os.cpu_count(),
        notes=f"{r['mode']} mode"
              + (f", rounds paced every {r['round_seconds']:g} s" if r.get("round_seconds")
                 else f", {r['inner_steps']} inner steps per round" if r["mode"] == "diloco" else "")
              + "; peers' memory and CPU include the hivemind processes each started (DHT, averagers, p2pd)",
    ), result_dir)


def _versions() -> str:
    from hivetrain.run_result import software_versions

    return ", ".join(f"{name} {version}" for name, version in software_versions().items() if name != "python")


def _write_logbook(path: Path, r: dict) -> None:
    best, last = r["best"], r["validations"][-1]
    curve = "\n".join(f"| {v['epoch']} | {v['time_s']:.0f} s | {v['top1']:.2%} | {v['top5']:.2%} | {v['loss']:.4f} |"
                      for v in r["validations"])
    contributions = "\n".join(f"| {name} | {samples} |" for name, samples in r["contributions"].items())
    schedule = RunConfig.from_dict(r["config"]).optim
    pace = (f"a round every {r['round_seconds']:g} s of the clock (its group looked for ahead), overlapped with the"
            f" next inner steps" if r.get("round_seconds") else
            f"{r['inner_steps']} inner steps per peer per round, overlapped with the next round's")
    mode = (f"diloco, {pace}; schedule of {schedule.total_steps} inner steps ({schedule.warmup_steps} of warmup)"
            if r["mode"] == "diloco" else f"sync, gradients averaged every {r['target_batch_size']} samples")
    share = "–" if r["swarm_time_share"] is None else f"{r['swarm_time_share']:.0%}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"""# Demo: a local swarm on digits

Written by `make demo` (`python scripts/demo.py`) on {r['date']} at commit {r['commit']}: a coordinator and two
volunteer peers on 127.0.0.1, one CPU thread each, preset `demo` (fingerprint `{r['fingerprint']}`: a tiny ViT at 32
px on scikit-learn's 8x8 digits). CPU run on a small preset; {r['machine']}; {r['versions']}.

| measure | value |
|---|---|
| peers | {r['peers']} |
| swarm mode | {mode} |
| samples per swarm epoch (diloco: trained, on average) / per-step batch of a peer | {r['epoch_samples']} / {r['batch_size']} |
| swarm epochs ({'outer rounds' if r['mode'] == 'diloco' else 'optimizer steps'}) | {r['swarm_epochs']} |
| wall time, first peer start to last peer exit | {r['wall_time_s']:.1f} s |
| swarm throughput (samples the peers trained / wall time) | {r['samples_per_s']:.1f} samples/s |
| swarm throughput while training (each peer's samples / its training time, summed) | {r['training_samples_per_s']:.1f} samples/s |
| DDP on the same cores at the same per-step batch (training time) | {r['ddp_samples_per_s']:.1f} samples/s (swarm while training: {r['training_samples_per_s'] / r['ddp_samples_per_s']:.2f}x) |
| the peers' time in swarm rounds and state downloads | {share} |
| training loss, first → last swarm epoch (peer1) | {r['first_loss']:.3f} → {r['last_loss']:.3f} |
| best validation top-1 / top-5 ({best['samples']} held-out digits) | {best['top1']:.2%} / {best['top5']:.2%} at swarm epoch {best['epoch']} |
| last validation top-1 / loss | {last['top1']:.2%} / {last['loss']:.4f} at swarm epoch {last['epoch']} |
| best checkpoint | `{r['best_checkpoint']}` |
| largest difference between the two peers' final weights | {r['max_weight_difference']:.2e} |

## Validation of the shared model, by the coordinator

| swarm epoch | time since start | top-1 | top-5 | loss |
|---|---|---|---|---|
{curve}

## Samples contributed

| peer | samples |
|---|---|
{contributions}

Raw numbers: `runs/demo/result.json` and the metrics store `runs/demo/metrics.sqlite` after a run; full logs in
`runs/demo/`.
""")


if __name__ == "__main__":
    sys.exit(main())
