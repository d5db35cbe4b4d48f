"""The repository's scripts started as processes, for the benchmarks, the demo and the tests: one way to start a role
(coordinator/start.py, peers/join.py, baselines/run.py, ...), keep its output, read its events, sample its CPU and
stop it; and a whole swarm of them (run_swarm), with what the suites read of it afterwards. No role imports this.

Figures come from what the roles write for programs: their events (`--events FILE`, hivetrain.events), the
coordinator's metrics store, and run results. Their console lines are for people; tests may check the wording.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent


def git_commit(short: bool = False) -> str:
    """The commit a page's figures were measured at (`git rev-parse HEAD`), marked when the working tree has
    uncommitted changes to tracked files: a figure from such a tree comes from no commit. The logbook's own pages are
    outputs, not inputs: `make logbook` writes the demo's before the tests that write the reliability page run."""
    try:
        head = subprocess.run(["git", "rev-parse", *(["--short"] if short else []), "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, check=True)
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!logbook"],
                                 cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git repository here: pass --commit)"
    return head.stdout.strip() + (" with uncommitted changes" if changed.stdout.strip() else "")


class Process:
    """A script of this repository run by this Python in its own process group (stopping it takes its hivemind
    processes and p2pd with it), its combined output kept line by line in `lines` and in the file `log`.

    With `events`, the script is given `--events FILE` and `events(name)` reads what it wrote. With `sample_cpu`, the
    CPU time of the process and of its descendants is sampled every second (`cpu_between`). `echo` sees every line as
    it arrives (the demo shows some of them). `prefix` runs the command inside another, e.g. `ip netns exec NAME`."""

    def __init__(self, args: list[str], log: Path, env: Optional[dict] = None, prefix: list[str] = (),
                 events: Optional[Path] = None, sample_cpu: bool = False, sample_every: float = 1.0,
                 echo: Optional[Callable[[str], None]] = None):
        self.log, self.events_path, self.echo = log, events, echo
        if events is not None:  # a role appends to its events file: a run in the same folder before must not count
            events.unlink(missing_ok=True)
        self.lines: list[str] = []
        self.times: list[float] = []  # when each line arrived (time.time())
        self.exited_at: Optional[float] = None  # when the process exited (what it started may take longer)
        self.cpu: list[tuple[float, float, float]] = []  # (time, CPU seconds of the main process, of its descendants)
        self.sample_every = sample_every
        self.started = time.time()
        self.popen = subprocess.Popen(
            [*prefix, sys.executable, *args, *(["--events", str(events)] if events is not None else [])],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})), start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        threading.Thread(target=self._note_exit, daemon=True).start()
        if sample_cpu:
            threading.Thread(target=self._sample_cpu, daemon=True).start()

    def _read(self) -> None:
        with self.log.open("w") as out:
            for line in self.popen.stdout:
                out.write(line)
                out.flush()  # the log is readable while the process runs
                self.times.append(time.time())
                self.lines.append(line.rstrip("\n"))
                if self.echo is not None:
                    self.echo(line)

    def _note_exit(self) -> None:
        self.popen.wait()
        self.exited_at = time.time()

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """The first output line matching `pattern`, waiting up to `timeout` seconds for it."""
        deadline = time.monotonic() + timeout
        while True:
            exited = self.popen.poll() is not None
            if exited:
                self._reader.join(5)  # its last lines
            for line in list(self.lines):
                if match := re.search(pattern, line):
                    return match
            if exited:
                raise RuntimeError(f"process exited ({self.popen.returncode}) before {pattern!r}; log {self.log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {pattern!r} within {timeout} s; log {self.log}")
            time.sleep(0.1)

    def events(self, name: str) -> list[dict]:
        """The events called `name` that the script has written so far, oldest first."""
        if self.events_path is None or not self.events_path.exists():
            return []
        with self.events_path.open() as lines:
            # a line being written may be incomplete: it is read at the next call
            return [event for line in lines if line.endswith("\n")
                    and (event := json.loads(line))["event"] == name]

    def event(self, name: str) -> dict:
        """The first event called `name`, which must be there."""
        found = self.events(name)
        if not found:
            raise RuntimeError(f"no {name!r} event in {self.events_path}; log {self.log}")
        return found[0]

    def wait_for_event(self, name: str, timeout: float) -> dict:
        """The first event called `name`, waiting up to `timeout` seconds for it."""
        deadline = time.monotonic() + timeout
        while not (found := self.events(name)):
            if self.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"no {name!r} event from {self.log} within {timeout} s (exit code"
                                   f" {self.popen.poll()})")
            time.sleep(0.05)
        return found[0]

    def _sample_cpu(self) -> None:
        """Every `sample_every` seconds: the CPU time (user + system) of the main process and of its descendants (a
        peer's DHT and averager processes, p2pd)."""
        import psutil

        with contextlib.suppress(psutil.Error):
            process = psutil.Process(self.popen.pid)
            while self.popen.poll() is None:
                main, descendants = sum(process.cpu_times()[:2]), 0.0
                for child in process.children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        descendants += sum(child.cpu_times()[:2])
                self.cpu.append((time.time(), main, descendants))
                time.sleep(self.sample_every)

    def cpu_between(self, start: float, end: float) -> tuple[float, float]:
        """CPU seconds of the main process and of its descendants between the first sample at or after `start` and
        the last at or before `end`, per second of that span."""
        inside = [sample for sample in list(self.cpu) if start <= sample[0] <= end]
        if len(inside) < 2:
            raise RuntimeError(f"too few CPU samples of {self.log} between {start:.0f} and {end:.0f}")
        (t0, main0, rest0), (t1, main1, rest1) = inside[0], inside[-1]
        return (main1 - main0) / (t1 - t0), (rest1 - rest0) / (t1 - t0)

    def cpu_seconds(self, at: float) -> float:
        """CPU seconds of the process and its descendants from its start to its last sample at or before `at`."""
        return max((main + descendants for when, main, descendants in list(self.cpu) if when <= at), default=0.0)

    def rss_bytes(self) -> int:
        """Resident memory of the process and its descendants now."""
        import psutil

        total, process = 0, psutil.Process(self.popen.pid)
        for one in [process, *process.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                total += one.memory_info().rss
        return total

    def wait(self, timeout: Optional[float]) -> int:
        """Its exit code; one still running after `timeout` seconds is stopped, and that is an error."""
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise RuntimeError(f"still running after {timeout} s; log {self.log}") from None
        self._reader.join(10)
        return code

    def dump_stacks(self, settle: float = 0.5) -> None:
        """Every thread's stack of each Python process it runs (the role and the DHT and averager processes it forked)
        into its log: SIGUSR1, which a role hands to faulthandler (hivetrain.swarm.run_role). For a test that gives up
        waiting on a role: what it hung on. One process at a time, `settle` seconds apart: they share the log, and
        dumps written at once interleave. p2pd, a Go program that SIGUSR1 would end, is left alone."""
        import psutil

        with contextlib.suppress(psutil.Error):
            main = psutil.Process(self.popen.pid)
            for process in [main, *main.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    if "python" in os.path.basename(process.exe()):
                        process.send_signal(signal.SIGUSR1)
                        time.sleep(settle)

    def leave(self, timeout: float = 60.0) -> None:
        """Stop it as a user does (SIGTERM to its main process, which shuts its own processes down); waits."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout)

    def kill(self) -> None:
        """Vanish without a goodbye, as a machine that loses power: SIGKILL to every process it started."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait()

    def stop(self) -> None:
        """SIGTERM, as a user's Ctrl-C; whatever is left of its process group after 30 s is killed."""
        self.leave(timeout=30)
        self.kill()


def run_baseline(work: Path, name: str, options: list[str], preset: str = "demo") -> dict:
    """One baselines/run.py run of `preset` with its output in `work/<name>.log`; returns its run result."""
    results = work / f"{name}-results"
    shutil.rmtree(results, ignore_errors=True)  # an earlier run's result is not this one's
    log = work / f"{name}.log"
    with log.open("w") as out:
        finished = subprocess.run([sys.executable, "baselines/run.py", "--preset", preset, "--progress-bar", "off",
                                   "--out-dir", str(work / name), "--result-dir", str(results), *options], cwd=ROOT,
                                  stdout=out, stderr=subprocess.STDOUT)
    if finished.returncode != 0:
        raise RuntimeError(f"baseline {name} failed (exit code {finished.returncode}); see {log}")
    [result] = results.glob("*.json")
    return json.loads(result.read_text())


def start_coordinator(work: Path, name: str, options: list[str], preset: str = "demo", host: str = "127.0.0.1",
                      prefix: list[str] = (), log_dir: Optional[Path] = None,
                      echo: Optional[Callable[[str], None]] = None) -> tuple[Process, list[str]]:
    """A coordinator of `preset` listening on `host` (inside the namespace of `prefix`), its key, log and events in
    `work/<name>.*` and its store, TensorBoard and checkpoints in `log_dir` (default: `work/<name>`), once it serves;
    returns it with the addresses peers join."""
    coordinator = Process(["coordinator/start.py", "--preset", preset, "--host", host, "--port", "0",
                           "--identity", str(work / f"{name}.key"), "--log-dir", str(log_dir or work / name),
                           *options], work / f"{name}.log", prefix=prefix, events=work / f"{name}.events",
                          sample_cpu=True, echo=echo)
    try:
        serving = coordinator.wait_for_event("serving", timeout=120)
    except RuntimeError:
        coordinator.stop()
        raise
    return coordinator, serving["initial_peers"]


def start_peer(work: Path, name: str, addresses: list[str], options: list[str], prefix: list[str] = (),
               echo: Optional[Callable[[str], None]] = None, program: Sequence[str] = ("peers/join.py",),
               cpu_every: float = 1.0) -> Process:
    """A peer called `name` joining the swarm at `addresses`, its log and events in `work/<name>.*`; `program`: what
    runs in place of peers/join.py, taking its arguments (a malicious peer: benchmarks/attacker.py ATTACK);
    `cpu_every`: seconds between two samples of its CPU time."""
    return Process([*program, "--initial-peers", *addresses, "--name", name, *options], work / f"{name}.log",
                   prefix=prefix, events=work / f"{name}.events", sample_cpu=True, sample_every=cpu_every, echo=echo)


def samples_trained_by(peers: list[Process], epoch: int) -> int:
    """The samples the peers had trained, all together, by the time each reached swarm epoch `epoch` (or its newest
    epoch before it): the cumulative counts of their epoch events."""
    return sum(max((event["samples"] for event in peer.events("epoch") if event["epoch"] <= epoch), default=0)
               for peer in peers)


def reached_epoch(peer: Process) -> int:
    """The newest swarm epoch the peer has reached while training (0 before its first)."""
    return max((event["epoch"] for event in peer.events("epoch")), default=0)


# The coordinator only bootstraps and monitors (a look at the swarm every 10 s, its default) unless a suite asks it to
# validate.
MONITOR_ONLY = ["--validate-every", "0"]
# A smoke run's coordinator looks every second: a swarm's run ends once the coordinator has read its peers' goodbyes
# (wait_until_marked_left), up to a look after they left; the full suites keep the default, as a run's owner would.
SMOKE_LOOKS = ["--refresh", "1"]


def validated_epoch(store: Path) -> int:
    """The newest swarm epoch the coordinator has validated, from its metrics store (-1 before its first)."""
    from hivetrain.metrics_store import MetricsReader, StoreMissing

    try:
        with MetricsReader(store) as reader:
            return max((row.epoch for row in reader.validations()), default=-1)
    except StoreMissing:
        return -1


def trained_together(peers: list[Process], epochs: int) -> bool:
    """Whether every peer has reached `epochs` swarm epochs since the last of them started training: enough for
    swarm_window (run_swarm's `until`, where a window in seconds could hold too few on a slow machine)."""
    if not all(peer.events("training_started") for peer in peers):
        return False
    started = max(peer.event("training_started")["time"] for peer in peers)
    return all(sum(event["time"] >= started for event in peer.events("epoch")) >= epochs for peer in peers)


def swarm_window(coordinator: Process, peers: list[Process]) -> dict:
    """Samples/s of a swarm while all its peers train: from each peer's epoch events (its cumulative samples) between
    the moment the last peer started training and the moment the first one stopped reaching epochs; each peer's share
    of its training time spent in swarm rounds and state downloads, and the rounds it missed (from its leaving event);
    and where the CPU went in that window: the peers' training processes, and everything else (their DHT, averager
    and p2pd processes, the coordinator), in cores."""
    started = max(peer.event("training_started")["time"] for peer in peers)
    epochs = [[(event["time"], event["epoch"], event["samples"]) for event in peer.events("epoch")
               if event["time"] >= started] for peer in peers]
    if any(len(peer_epochs) < 2 for peer_epochs in epochs):
        raise RuntimeError("a peer reached fewer than two epochs while all trained: make the window longer")
    ended = min(peer_epochs[-1][0] for peer_epochs in epochs)
    rate = 0.0
    for peer_epochs in epochs:
        inside = [epoch for epoch in peer_epochs if epoch[0] <= ended]
        if len(inside) < 2:  # this peer's next epoch came just after the window: use its last two
            inside = peer_epochs[-2:]
        rate += (inside[-1][2] - inside[0][2]) / (inside[-1][0] - inside[0][0])
    left = [peer.event("left") for peer in peers]
    training_cores = background_cores = 0.0
    for role in (coordinator, *peers):
        main, descendants = role.cpu_between(started, ended)
        training_cores += main if role is not coordinator else 0.0
        background_cores += descendants + (main if role is coordinator else 0.0)
    return dict(samples_per_s=rate, window_s=ended - started,
                epochs=max(epoch[1] for peer_epochs in epochs for epoch in peer_epochs)
                - min(peer_epochs[0][1] for peer_epochs in epochs),
                swarm_time_share=[event["swarm_seconds"] / event["train_seconds"] for event in left],
                missed_rounds=sum(event["missed_rounds"] for event in left),
                training_cores=training_cores, background_cores=background_cores)


def run_swarm(work: Path, name: str, peers: int, coordinator_options: list[str], peer_options: list[str],
              timeout: float, preset: str = "demo", until: Optional[Callable[[list[Process]], bool]] = None,
              network=None, programs: Optional[dict[int, list[str]]] = None) -> tuple[Process, list[Process]]:
    """A coordinator and `peers` peers (one torch thread each, waiting for each other) that train until
    `peer_options` make them leave ("{index}" in an option becomes the peer's index), or, with `until`, until it
    holds for the running peers (they are then stopped as a volunteer stops one, by SIGTERM); returns the stopped
    roles, their output kept. With `network` (benchmarks.netns.LinkedNamespaces), the coordinator and peer 0 run in
    its namespace a and peer 1 in b, so that everything between the two peers crosses its link. `programs`: by peer
    index, what runs in place of peers/join.py (benchmarks.harness.start_peer)."""
    roles: list[Process] = []
    try:
        options = [*MONITOR_ONLY, *coordinator_options]
        if network is None:
            coordinator, addresses = start_coordinator(work, name, options, preset)
        else:
            coordinator, addresses = start_coordinator(work, name, options, preset, host=network.a_ip,
                                                       prefix=network.exec_prefix("a"))
        roles.append(coordinator)
        for index in range(peers):
            side = "a" if index % 2 == 0 else "b"
            where = [] if network is None else ["--host", network.a_ip if side == "a" else network.b_ip,
                                                "--client-mode", "off"]
            roles.append(start_peer(work, f"{name}-peer-{index}", addresses, [
                "--threads", "1", "--min-peers", str(peers), "--seed", str(index), "--progress-bar", "off", *where,
                *(option.replace("{index}", str(index)) for option in peer_options)],
                prefix=[] if network is None else network.exec_prefix(side),
                program=(programs or {}).get(index, ("peers/join.py",))))
        deadline = time.monotonic() + timeout
        while until is not None and not until(roles[1:]):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not get where it should within {timeout:.0f} s; see {work}")
            if any(peer.popen.poll() is not None for peer in roles[1:]):
                raise RuntimeError(f"a peer of {name} left early; see {work}")
            time.sleep(0.2)
        for peer in roles[1:] if until is not None else ():
            peer.leave()
        for peer in roles[1:]:
            try:
                peer.popen.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"a peer of {name} was still running after {timeout:.0f} s; see {peer.log}")
            if peer.popen.returncode != 0:
                raise RuntimeError(f"a peer of {name} failed (exit code {peer.popen.returncode}); see {peer.log}")
        # the figures read from the coordinator's store afterwards must be the peers' last: their goodbyes
        wait_until_marked_left(work / name / "metrics.sqlite", [peer.log.stem for peer in roles[1:]], timeout=30)
        return coordinator, roles[1:]
    finally:
        for role in reversed(roles):
            role.stop()


def wait_until_marked_left(store: Path, names: list[str], timeout: float) -> None:
    """Wait until the coordinator's store has marked the peers called `names` left: it has read their goodbye
    records, which carry their last figures (a peer that has exited may be gone before the coordinator's next look)."""
    from hivetrain.metrics_store import MetricsReader

    deadline = time.monotonic() + timeout
    while True:
        with MetricsReader(store) as reader:
            missing = set(names) - {peer.name for peer in reader.peers() if peer.left_at is not None}
        if not missing:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the coordinator did not mark {', '.join(sorted(missing))} left within {timeout:.0f} s"
                               f" of their exit; see {store}")
        time.sleep(0.5)


def wait_until_validated(store: Path, epoch: int, timeout: float) -> bool:
    """Wait until the coordinator's store holds a validation of swarm epoch `epoch` or later; whether it did within
    `timeout` seconds. The last peers leave once the coordinator holds their state (hivetrain.hand_over), before it
    has validated it."""
    from hivetrain.metrics_store import MetricsReader

    deadline = time.monotonic() + timeout
    while True:
        with MetricsReader(store) as reader:
            if any(validation.epoch >= epoch for validation in reader.validations()):
                return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def evaluate_weights(paths: list[Path]) -> list[float]:
    """Validation top-1 of weights saved by peers (--save-weights), on the demo preset's whole validation split."""
    import dataclasses

    from hivetrain.config import get_preset
    from hivetrain.datasets import validation_loader
    from hivetrain.evaluate import evaluate
    from hivetrain.model import create_model, load_weights

    config = get_preset("demo")
    loader = validation_loader(config)
    model = create_model(dataclasses.replace(config.model, pretrained=False))
    top1 = []
    for path in paths:
        load_weights(path, model)
        top1.append(evaluate(model, loader)["top1"])
    return top1
