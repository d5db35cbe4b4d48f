"""The embedded default: a coordinator and two volunteer peers on this machine train the `demo` preset (a tiny ViT on
scikit-learn's digits). The coordinator validates the shared model as it trains and keeps the best checkpoint; the
run is written to runs/demo/logbook/demo.md from its metrics store (with --publish, `make logbook`: to logbook/).

    python scripts/demo.py [--epochs 50]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUR_LINES = re.compile(r"^(Run |To join|  python|Only loopback|Metrics|Joined run|Starting at|swarm epoch|validation at|"
                       r"best checkpoint|Leaving|Saved|Left|error)")


def _stream(name: str, process: subprocess.Popen, log: Path, lines: list[str]) -> None:
    """Keep the full output in a log file; show the lines meant for people, prefixed with who said them."""
    with log.open("w") as out:
        for line in process.stdout:
            out.write(line)
            out.flush()
            lines.append(line)
            if OUR_LINES.match(line):
                print(f"[{name}] {line}", end="", flush=True)


def _start(name: str, command: list[str], workdir: Path, lines: list[str]) -> subprocess.Popen:
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    threading.Thread(target=_stream, args=(name, process, workdir / f"{name}.log", lines), daemon=True).start()
    return process


class PeerSampler(threading.Thread):
    """CPU % and resident memory of each peer (its process and the hivemind processes it started), every second."""

    def __init__(self, pids: list[int], interval: float = 1.0):
        super().__init__(daemon=True)
        import psutil

        self.psutil, self.pids, self.interval = psutil, pids, interval
        self.samples: list = []
        self.peak_rss = [0] * len(pids)
        self._tracked: dict[int, object] = {}
        self._stop_event = threading.Event()
        self._t0 = time.monotonic()

    def _tree(self, pid: int) -> list:
        try:
            root = self.psutil.Process(pid)
            processes = [root, *root.children(recursive=True)]
        except self.psutil.NoSuchProcess:
            return []
        # keep one Process object per pid: cpu_percent measures since that object's previous call
        return [self._tracked.setdefault(p.pid, p) for p in processes]

    def run(self) -> None:
        from hivetrain.records import UtilisationSample

        self.psutil.cpu_percent(None)
        while not self._stop_event.wait(self.interval):
            system = self.psutil.cpu_percent(None)
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
                    self.samples.append(UtilisationSample(
                        time_s=round(time.monotonic() - self._t0, 2), rank=rank, cpu_percent=round(cpu, 1),
                        system_cpu_percent=system, rss_bytes=rss,
                    ))

    def stop(self) -> None:
        self._stop_event.set()
        self.join(5)


def _free_port(preferred: int) -> int:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", preferred))
        except OSError:
            sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_dashboard(workdir: Path, preferred_port: int) -> subprocess.Popen:
    """The dashboard on the demo's metrics store; it shows "waiting for the coordinator" until the store exists."""
    from dashboard.launch import streamlit_command

    port = _free_port(preferred_port)
    process = subprocess.Popen(streamlit_command(workdir / "metrics.sqlite", "127.0.0.1", port), cwd=ROOT,
                               stdout=(workdir / "dashboard.log").open("w"), stderr=subprocess.STDOUT)
    print(f"Dashboard: http://127.0.0.1:{port} (live peers, validation curve, checkpoints)", flush=True)
    return process


def _stop(process: subprocess.Popen, timeout: float = 30) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python scripts/demo.py")
    parser.add_argument("--epochs", type=int, default=50, help="swarm epochs to train (128 samples each)")
    parser.add_argument("--workdir", default=str(ROOT / "runs" / "demo"), help="where logs and weights go")
    parser.add_argument("--logbook", default=None,
                        help="the page written at the end (default: <workdir>/logbook/demo.md; with --publish,"
                             " logbook/demo.md)")
    parser.add_argument("--dashboard-port", type=int, default=8501,
                        help="where the dashboard serves on 127.0.0.1 (default: %(default)s; a free one when busy)")
    parser.add_argument("--record-dir", default=None,
                        help="where the swarm's run record goes ('' for none; default: <workdir>/records; with"
                             " --publish, logbook/records); the demo's baselines page is rebuilt beside its page from"
                             " that folder and the committed baseline records in logbook/records")
    parser.add_argument("--publish", action="store_true",
                        help="write the page and the run record into the repository's logbook/ (make logbook): the"
                             " committed logbook changes only when asked")
    args = parser.parse_args(argv)
    logbook = ROOT / "logbook" if args.publish else Path(args.workdir) / "logbook"
    args.logbook = args.logbook or str(logbook / "demo.md")
    if args.record_dir is None:
        args.record_dir = str(logbook / "records")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    for previous in ("metrics.sqlite", "metrics.sqlite-wal", "metrics.sqlite-shm", "checkpoints", "tensorboard"):
        path = workdir / previous  # each demo is a run of its own: its best checkpoint must beat nothing older
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    python = sys.executable
    lines: dict[str, list[str]] = {name: [] for name in ("coordinator", "peer1", "peer2")}

    print(f"HiveTrain demo: a coordinator and two peers on 127.0.0.1 train for {args.epochs} swarm epochs."
          f" Full logs: {workdir}/", flush=True)
    coordinator = _start("coordinator", [
        python, "coordinator/start.py", "--preset", "demo", "--host", "127.0.0.1", "--port", "0",
        "--identity", str(workdir / "coordinator.key"), "--refresh", "2", "--log-dir", str(workdir),
    ], workdir, lines["coordinator"])
    peers: list[subprocess.Popen] = []
    dashboard = _start_dashboard(workdir, args.dashboard_port)
    try:
        deadline = time.monotonic() + 120
        address = None
        while address is None:
            if coordinator.poll() is not None or time.monotonic() > deadline:
                print("error: the coordinator did not start; see its log", file=sys.stderr)
                return 1
            found = [line for line in lines["coordinator"] if "peers/join.py --initial-peers" in line]
            address = found[0].split("--initial-peers", 1)[1].split() if found else None
            time.sleep(0.2)
        started, started_unix = time.monotonic(), time.time()
        started_at = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        for i in (1, 2):
            peers.append(_start(f"peer{i}", [
                python, "peers/join.py", "--initial-peers", *address, "--host", "127.0.0.1", "--name", f"peer{i}",
                "--threads", "1", "--min-peers", "2",
                "--stop-at-epoch", str(args.epochs), "--save-weights", str(workdir / f"peer{i}.safetensors"),
            ], workdir, lines[f"peer{i}"]))
        sampler = PeerSampler([peer.pid for peer in peers])
        sampler.start()
        codes = [peer.wait() for peer in peers]
        wall_time = time.monotonic() - started
        sampler.stop()
        time.sleep(5)  # one more look of the monitor (every 2 s) records the peers' last records
    except KeyboardInterrupt:
        print("Stopping the demo.", flush=True)
        return 130
    finally:
        for process in [*peers, coordinator, dashboard]:
            _stop(process)
    if any(codes):
        print(f"error: a peer failed (exit codes {codes}); see {workdir}/peer*.log", file=sys.stderr)
        return 1
    result = _measure(workdir, args.epochs, wall_time, lines, started_unix)
    (workdir / "result.json").write_text(json.dumps(result, indent=2))
    _write_logbook(Path(args.logbook), result)
    if args.record_dir:
        record = _write_record(Path(args.record_dir), workdir, result, sampler, started_at,
                               " ".join(["python", *sys.argv]))
        from hivetrain.logbook import build

        # The committed baselines of the preset beside this run (the same folder when publishing).
        folders = list(dict.fromkeys([ROOT / "logbook" / "records", Path(args.record_dir).resolve()]))
        records, out = " ".join(_shown(folder) for folder in folders), _shown(Path(args.logbook).parent)
        pages = build(folders, Path(args.logbook).parent, "demo",
                      f"python -m hivetrain.logbook build --records {records} --out {out}")
        print(f"Swarm run record: {record}; logbook pages: {', '.join(map(str, pages))}", flush=True)
    best = result["best"]
    print(f"\nBest validation on {best['samples']} held-out digits: top-1 {best['top1']:.1%}, top-5"
          f" {best['top5']:.1%}, loss {best['loss']:.3f} at swarm epoch {best['epoch']} (checkpoint"
          f" {result['best_checkpoint']}); {result['swarm_epochs']} swarm epochs in"
          f" {result['wall_time_s']:.0f} s ({result['samples_per_s']:.0f} samples/s); the two peers' weights differ by"
          f" at most {result['max_weight_difference']:.2e}.\nWritten to {args.logbook} and {workdir}/result.json",
          flush=True)
    return 0


def _measure(workdir: Path, epochs: int, wall_time: float, lines: dict[str, list[str]], started_unix: float) -> dict:
    import torch

    from hivetrain.config import get_preset
    from hivetrain.metrics_store import MetricsReader
    from hivetrain.model import create_model, load_weights

    config = get_preset("demo")
    models, epochs_reached = [], []
    for i in (1, 2):
        model = create_model(config.model, seed=config.seed)
        epochs_reached.append(int(load_weights(workdir / f"peer{i}.safetensors", model)["epoch"]))
        models.append(model)
    difference = max((a - b).abs().max().item() for a, b in zip(models[0].parameters(), models[1].parameters()))
    with MetricsReader(workdir / "metrics.sqlite") as store:
        validations = [dict(epoch=v.epoch, time_s=round(v.time - started_unix, 1), top1=v.top1, top5=v.top5,
                            loss=v.loss, samples=v.samples) for v in store.validations()]
        best = next((c for c in store.checkpoints() if c.best), None)
        contributions = {p.name: p.samples for p in store.peers()}
    if not validations or best is None:
        raise RuntimeError(f"the coordinator recorded no validation; see {workdir}/coordinator.log")
    best_validation = max(validations, key=lambda v: v["top1"])  # the first of the best, as the store picks it
    swarm_epochs = min(epochs_reached)
    losses = [float(m.group(1)) for line in lines["peer1"] if (m := re.search(r"loss ([0-9.]+)", line))]
    return dict(
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, no GPU",
        versions=_versions(),
        preset="demo", fingerprint=config.fingerprint, peers=2, threads_per_peer=1,
        target_batch_size=config.swarm.target_batch_size, batch_size=config.batch_size,
        swarm_epochs=swarm_epochs, wall_time_s=round(wall_time, 1),
        samples_per_s=round(swarm_epochs * config.swarm.target_batch_size / wall_time, 1),
        first_loss=losses[0] if losses else None, last_loss=losses[-1] if losses else None,
        validations=validations, best=best_validation, best_checkpoint=_shown(Path(best.uri)),
        contributions=contributions, max_weight_difference=difference, torch_threads=torch.get_num_threads(),
    )


def _shown(path: Path) -> str:
    """A path as the logbook shows it: relative to the repository when it lies inside."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _write_record(record_dir: Path, workdir: Path, r: dict, sampler: PeerSampler, started_at: str,
                  command: str) -> Path:
    """The demo as a run record of strategy "swarm", so the logbook sets it beside single, DDP and FSDP."""
    from hivetrain.config import get_preset
    from hivetrain.records import RankMemory, RunRecord, ValidationPoint, cpu_name, software_versions, write_record

    config = get_preset("demo")
    samples = r["swarm_epochs"] * r["target_batch_size"]
    passes = samples // 1437  # digits' training split
    return write_record(RunRecord(
        name=f"demo-swarm-{r['peers']}peers-{started_at.replace(':', '').replace('-', '')[:15]}",
        experiment="demo", strategy="swarm", preset="demo", config=config.to_dict(), fingerprint=config.fingerprint,
        command=command, started_at=started_at, host=os.uname().nodename, accelerator="cpu", device_name=cpu_name(),
        versions=software_versions(), num_nodes=1, devices_per_node=r["peers"], world_size=r["peers"],
        threads=r["threads_per_peer"], precision="32", batch_size=r["batch_size"], batch_size_auto=False,
        accumulate=r["target_batch_size"] // (r["batch_size"] * r["peers"]), global_batch_size=r["target_batch_size"],
        epochs=passes, steps=r["swarm_epochs"], train_samples=samples, wall_time_s=r["wall_time_s"],
        train_time_s=r["wall_time_s"], samples_per_s=r["samples_per_s"],
        # the coordinator validates the shared model as the swarm trains (its metrics store)
        validation=[ValidationPoint(epoch=v["epoch"] * r["target_batch_size"] // 1437, step=v["epoch"],
                                    time_s=v["time_s"], loss=round(v["loss"], 6), top1=round(v["top1"], 6),
                                    top5=round(v["top5"], 6)) for v in r["validations"]],
        memory=[RankMemory(rank=rank, host=os.uname().nodename, peak_rss_bytes=peak)
                for rank, peak in enumerate(sampler.peak_rss)],
        utilisation=sampler.samples, best_checkpoint=r["best_checkpoint"],
        best_top1=round(r["best"]["top1"], 6), cpu_count=os.cpu_count(),
        notes="peers' memory and CPU include the hivemind processes each started (DHT, averagers, p2pd)",
    ), record_dir)


def _versions() -> str:
    from hivetrain.records import software_versions

    return ", ".join(f"{name} {version}" for name, version in software_versions().items() if name != "python")


def _write_logbook(path: Path, r: dict) -> None:
    best, last = r["best"], r["validations"][-1]
    curve = "\n".join(f"| {v['epoch']} | {v['time_s']:.0f} s | {v['top1']:.2%} | {v['top5']:.2%} | {v['loss']:.4f} |"
                      for v in r["validations"])
    contributions = "\n".join(f"| {name} | {samples} |" for name, samples in r["contributions"].items())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"""# Demo: a local swarm on digits

Written by `make demo` (`python scripts/demo.py`) on {r['date']}: a coordinator and two volunteer peers on
127.0.0.1, one CPU thread each, preset `demo` (fingerprint `{r['fingerprint']}`: a tiny ViT at 32 px on
scikit-learn's 8x8 digits). CPU run on a small preset; {r['machine']}; {r['versions']}.

| measure | value |
|---|---|
| peers | {r['peers']} |
| target batch / per-step batch | {r['target_batch_size']} / {r['batch_size']} |
| swarm epochs (optimizer steps) | {r['swarm_epochs']} |
| wall time, first peer start to last peer exit | {r['wall_time_s']:.1f} s |
| swarm throughput | {r['samples_per_s']:.1f} samples/s |
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
