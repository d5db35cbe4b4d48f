"""Benchmarks whose numbers land in the logbook: python -m hivetrain.bench SUITE [--smoke].

Each suite starts real roles (coordinator/start.py, peers/join.py) as processes on loopback and measures them from
their output, and writes its section of logbook/benchmarks.md with the machine, versions, commit and date.

Suites here: join (time from `peers/join.py` start to the swarm's state loaded, and to its first local step).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "logbook" / "benchmarks.md"
RECORDS = ROOT / "logbook" / "records"


class Role:
    """A role's process, its output lines kept with the time each arrived."""

    def __init__(self, args: list[str], log: Path):
        self.started = time.time()
        self.lines: list[tuple[float, str]] = []
        self.popen = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True,
                                      env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self._log = log
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with self._log.open("w") as out:
            for line in self.popen.stdout:
                out.write(line)
                self.lines.append((time.time(), line.rstrip("\n")))

    def first(self, pattern: str) -> tuple[float, re.Match] | None:
        for arrived, line in list(self.lines):
            if match := re.search(pattern, line):
                return arrived, match
        return None

    def wait_for(self, pattern: str, timeout: float) -> tuple[float, re.Match]:
        deadline = time.monotonic() + timeout
        while (found := self.first(pattern)) is None:
            if self.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"no {pattern!r} from {self._log} (exit code {self.popen.poll()})")
            time.sleep(0.05)
        return found

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, 15)
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, 9)
                self.popen.wait()


def _epoch(role: Role) -> int:
    return max((int(m.group(1)) for _, line in list(role.lines) if (m := re.match(r"swarm epoch (\d+) ", line))),
               default=0)


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


def join_suite(work: Path, joiners: int) -> dict:
    """A coordinator and a seed peer that keeps training; `joiners` peers join one after another. For each: seconds
    from its process start to "Joined the swarm" (state downloaded) and to its first local step."""
    imports = import_seconds(repeats=1 if joiners == 1 else 3)  # on the idle machine, before any role starts
    roles: list[Role] = []
    try:
        coordinator = Role(["coordinator/start.py", "--preset", "demo", "--host", "127.0.0.1", "--port", "0",
                            "--identity", str(work / "coordinator.key"), "--log-dir", str(work / "run"),
                            "--validate-every", "0", "--refresh", "2"], work / "coordinator.log")
        roles.append(coordinator)
        _, match = coordinator.wait_for(r"peers/join.py --initial-peers (.+)$", timeout=120)
        addresses = match.group(1).split()
        seed = Role(["peers/join.py", "--initial-peers", *addresses, "--name", "seed", "--threads", "1"],
                    work / "seed.log")
        roles.append(seed)
        deadline = time.monotonic() + 300
        while _epoch(seed) < 3:  # a state worth downloading
            if time.monotonic() > deadline or seed.popen.poll() is not None:
                raise RuntimeError(f"the seed peer did not reach epoch 3; see {work / 'seed.log'}")
            time.sleep(0.2)
        results = []
        for index in range(joiners):
            joiner = Role(["peers/join.py", "--initial-peers", *addresses, "--name", f"joiner-{index}",
                           "--threads", "1", "--max-steps", "3"], work / f"joiner-{index}.log")
            roles.append(joiner)
            loaded, match = joiner.wait_for(r"Joined the swarm at epoch (\d+)", timeout=180)
            stepped, _ = joiner.wait_for(r"^First local step done", timeout=180)
            joiner.popen.wait(120)
            results.append(dict(state_loaded_s=loaded - joiner.started, first_step_s=stepped - joiner.started,
                                epoch=int(match.group(1))))
            print(f"joiner {index}: state loaded after {results[-1]['state_loaded_s']:.1f} s (epoch"
                  f" {results[-1]['epoch']}), first step after {results[-1]['first_step_s']:.1f} s", flush=True)
        return dict(preset="demo", joiners=results, import_seconds=imports,
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


def _join_section(result: dict, env: dict) -> str:
    rows = "\n".join(f"| {i} | {r['epoch']} | {r['state_loaded_s']:.1f} | {r['first_step_s']:.1f} |"
                     for i, r in enumerate(result["joiners"]))
    return (
        "## join\n\n"
        f"`python -m hivetrain.bench join` on {env['date']}, commit {env['commit']} ({env['machine']}; Python"
        f" {env['python']}, torch {env['torch']}, hivemind {env['hivemind']}). A coordinator and a seed peer training"
        f" the `{result['preset']}` preset on loopback (one torch thread each); {len(result['joiners'])} peers join"
        " one after another. Seconds from the joiner's process start.\n\n"
        "| joiner | joined at epoch | state loaded (s) | first local step (s) |\n|---:|---:|---:|---:|\n"
        f"{rows}\n\n"
        f"Median: state loaded after {result['median_state_loaded_s']:.1f} s, first local step after"
        f" {result['median_first_step_s']:.1f} s (target: ≤ 10 s; plain hivemind 1.1.12 measured 7.8 s and 9.2 s"
        " on this kind of machine).\n\n"
        "Where the time goes before anything runs: a fresh interpreter's imports, measured on the idle machine before"
        " the roles start (median of 3):\n\n| imports | seconds |\n|---|---:|\n"
        + "".join(f"| {modules} | {seconds:.1f} |\n" for modules, seconds in result["import_seconds"].items())
    )


SUITES = {"join": (join_suite, _join_section)}


def write_section(name: str, section: str) -> None:
    """Replace suite `name`'s section of logbook/benchmarks.md (each section says which commit measured it)."""
    header = ("# Benchmarks\n\nEach section is written by `python -m hivetrain.bench SUITE` and says which commit,"
              " machine and versions measured it.\n\n")
    sections = {}
    if PAGE.exists():
        for part in re.split(r"(?m)^(?=## )", PAGE.read_text())[1:]:
            sections[part.split("\n", 1)[0][3:].strip()] = part.rstrip("\n") + "\n\n"
    sections[name] = section.rstrip("\n") + "\n\n"
    PAGE.write_text(header + "".join(sections[key] for key in sorted(sections)).rstrip("\n") + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hivetrain.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("suite", choices=sorted(SUITES))
    parser.add_argument("--smoke", action="store_true", help="the smallest run (for the tests): prints, writes nothing")
    parser.add_argument("--joiners", type=int, default=5, help="join suite: how many peers join (default: %(default)s)")
    args = parser.parse_args(argv)
    run, section = SUITES[args.suite]
    with tempfile.TemporaryDirectory(prefix=f"hivetrain-bench-{args.suite}-") as work:
        result = run(Path(work), joiners=1 if args.smoke else args.joiners)
    print(json.dumps(result, indent=1))
    if args.smoke:
        return 0
    env = _environment()
    RECORDS.mkdir(parents=True, exist_ok=True)
    record = RECORDS / f"bench-{args.suite}-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}.json"
    record.write_text(json.dumps(dict(suite=args.suite, environment=env, result=result), indent=1) + "\n")
    write_section(args.suite, section(result, env))
    print(f"Wrote {PAGE.relative_to(ROOT)} ({args.suite}) and {record.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
