"""The churn suite: a diloco swarm of 4 peers on the tiny preset first trains undisturbed, then for 5 minutes peers
leave, cleanly (SIGTERM) or killed (SIGKILL), each replaced at once by a new one, at seeded random intervals of 30 s on
average. It measures what volunteers coming and going cost the run:

- the swarm's samples/s under churn against the undisturbed window before it;
- for each departure, how long until hivemind's progress records no longer count the peer (what rounds wait for)
  and until the coordinator marks it left;
- each joiner's time from its process start to its state and its first step;
- the samples departed peers trained after their last round (computed, never applied), and the rounds that were
  averaged, taken alone or failed in each phase;
- where the machine's CPU went: every role shares its cores, so each joiner's start-up (its CPU seconds to its first
  step) and each leaver's exit (seconds from the signal until its command returned, and the CPU seconds it used
  meanwhile) is taken from the peers that train, as it would not be on volunteers' own machines.

Figures come from the peers' events, the coordinator's metrics store and a DHT reader polling the progress key.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import threading
import time
from pathlib import Path

from benchmarks.harness import Process, start_coordinator, start_peer

PEERS = 4
INNER_STEPS = 8  # a round every 10-20 s here: a departure costs at most that much of one peer's work
STEADY_S, CHURN_S = 120.0, 300.0  # smoke: SMOKE_STEADY_S, SMOKE_CHURN_S
SMOKE_STEADY_S, SMOKE_CHURN_S = 25.0, 20.0
GAP_S = (20.0, 40.0)  # seconds between two churn events, uniformly: one every 30 s on average
SMOKE_GAP_S = (5.0, 10.0)  # a smoke run's first event comes early: the run is over soon after it
SEED = 15
POLL_S = 0.25  # how often the DHT reader looks at the progress records
JOIN_WAIT_S = 180.0  # seconds after the churn window to wait for the last joiners' first steps


class CountWatch(threading.Thread):
    """Polls hivemind's progress records of the run: `counted` is the set of peer IDs (base58) they count now, and
    `gone_at(peer_id, since)` the first poll after `since` that did not count the peer."""

    def __init__(self, addresses: list[str], run_id: str):
        super().__init__(daemon=True)
        import hivemind
        from hivemind.dht.crypto import RSASignatureValidator

        self.dht = hivemind.DHT(initial_peers=addresses, client_mode=True, start=True,
                                record_validators=[RSASignatureValidator()])
        self.key = f"{run_id}_progress"
        self.polls: list[tuple[float, set[str]]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        from hivemind.p2p import PeerID

        while not self.stopped.wait(POLL_S):
            try:
                found = self.dht.get(self.key, latest=True, return_future=True).result(timeout=5)
            except Exception:  # a slow read: the next poll
                continue
            entries = found.value if found is not None and isinstance(found.value, dict) else {}
            counted = {PeerID(entry.value["peer_id"]).to_base58() for entry in entries.values()
                       if isinstance(entry.value, dict) and isinstance(entry.value.get("peer_id"), bytes)}
            self.polls.append((time.time(), counted))

    def gone_at(self, peer_id: str, since: float, timeout: float = 60.0) -> float | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for at, counted in list(self.polls):
                if at >= since and peer_id not in counted:
                    return at
            time.sleep(POLL_S)
        return None

    def close(self) -> None:
        self.stopped.set()
        self.join(10)
        self.dht.shutdown()


def busy_cpu_seconds() -> float:
    """CPU seconds this machine's cores have been busy since boot (all processes)."""
    import psutil

    times = psutil.cpu_times()
    return times.user + times.nice + times.system + times.irq + times.softirq + times.steal


def applied_samples(peer: Process, start: float, end: float) -> int:
    """Samples the peer trained that reached a round between `start` and `end`: its cumulative samples at its last
    swarm epoch by `end` less those at its last one by `start` (each epoch of a diloco peer ends a round)."""
    def at(moment: float) -> int:
        return max((e["samples"] for e in peer.events("epoch") if e["time"] <= moment), default=0)

    return at(end) - at(start)


def peer_rows(store: Path) -> dict:
    """The coordinator's row of each peer it has seen (hivetrain.metrics_store.PeerRow), by peer ID."""
    from hivetrain.metrics_store import MetricsReader

    with MetricsReader(store) as reader:
        return {p.peer_id: p for p in reader.peers()}


def rounds_by_peer(store: Path) -> dict[str, tuple[int, int, int]]:
    """Each peer's outer rounds so far (averaged, alone, failed)."""
    return {peer_id: (p.rounds_averaged or 0, p.rounds_alone or 0, p.rounds_failed or 0)
            for peer_id, p in peer_rows(store).items()}


def churn_suite(work: Path, smoke: bool) -> dict:
    from benchmarks.harness import MONITOR_ONLY
    from hivetrain.config import diloco_schedule_flags, get_preset

    steady_s, churn_s, gap_s = (SMOKE_STEADY_S, SMOKE_CHURN_S, SMOKE_GAP_S) if smoke else (STEADY_S, CHURN_S, GAP_S)
    rng = random.Random(SEED)
    config = get_preset("demo")
    store = work / "churn" / "metrics.sqlite"
    roles: list[Process] = []
    watch = None
    try:
        coordinator, addresses = start_coordinator(
            work, "churn", [*MONITOR_ONLY, "--mode", "diloco", "--inner-steps", str(INNER_STEPS), "--refresh", "1",
                            *diloco_schedule_flags(config, PEERS)])
        roles.append(coordinator)
        run_id = coordinator.event("serving")["run_id"]
        joined = 0

        def new_peer(wait_for_all: bool) -> Process:
            nonlocal joined
            peer = start_peer(work, f"churn-peer-{joined}", addresses, [
                "--threads", "1", "--seed", str(joined), "--progress-bar", "off",
                *(["--min-peers", str(PEERS)] if wait_for_all else [])])
            joined += 1
            roles.append(peer)
            return peer

        training = [new_peer(wait_for_all=True) for _ in range(PEERS)]
        for peer in training:
            peer.wait_for_event("training_started", timeout=300)
        watch = CountWatch(addresses, run_id)
        watch.start()
        for peer in training:  # every peer through its first round (its first epoch event: the round landed)
            peer.wait_for_event("epoch", timeout=300)
        steady_from, rounds_start, busy_from = time.time(), rounds_by_peer(store), busy_cpu_seconds()
        time.sleep(steady_s)
        churn_from, busy_steady = time.time(), busy_cpu_seconds()
        rounds_steady = rounds_by_peer(store)
        steady_rate = sum(applied_samples(p, steady_from, churn_from) for p in training) / (churn_from - steady_from)
        print(f"steady: {steady_rate:.1f} samples/s over {churn_from - steady_from:.0f} s", flush=True)

        departures, everyone = [], list(training)
        next_at = churn_from + rng.uniform(*gap_s)
        while next_at < churn_from + churn_s:
            time.sleep(max(0.0, next_at - time.time()))
            victim = rng.choice(training)
            kind = rng.choice(("leave", "kill"))
            peer_id = victim.event("state_loaded")["peer_id"]
            at = time.time()
            if kind == "kill":
                victim.kill()
            else:
                victim.popen.send_signal(signal.SIGTERM)
            joiner = new_peer(wait_for_all=False)
            training = [p for p in training if p is not victim] + [joiner]
            everyone.append(joiner)
            departures.append(dict(kind=kind, peer=victim, peer_id=peer_id, at=at, joiner=joiner))
            print(f"{time.time() - churn_from:.0f} s: {kind} {victim.log.stem}, {joiner.log.stem} joins", flush=True)
            next_at += rng.uniform(*gap_s)
        time.sleep(max(0.0, churn_from + churn_s - time.time()))
        churn_to, busy_churn = time.time(), busy_cpu_seconds()
        rounds_end = rounds_by_peer(store)
        churn_rate = sum(applied_samples(p, churn_from, churn_to) for p in everyone) / (churn_to - churn_from)
        print(f"churn: {churn_rate:.1f} samples/s over {churn_to - churn_from:.0f} s", flush=True)

        events = []
        for d in departures:
            victim, joiner = d["peer"], d["joiner"]
            if d["kind"] == "leave":
                victim.wait(timeout=60)  # signalled once already: a second SIGTERM would cut its goodbye short
            gone = watch.gone_at(d["peer_id"], d["at"])
            row = peer_rows(store).get(d["peer_id"])
            marked = row.left_at if row is not None else None
            left = victim.events("left")
            # what it trained: its goodbye says; a killed peer's last record in the store is the best there is
            computed = left[0]["samples"] if left else row.samples if row is not None else 0
            applied = max((e["samples"] for e in victim.events("epoch")), default=0)
            try:
                # a joiner's start-up takes tens of CPU seconds on cores the others keep busy: 66-68 s to its first
                # step in a smoke run here on a slow day, past a 60 s wait, and the row had no join at all
                first_step = joiner.wait_for_event("first_step", timeout=JOIN_WAIT_S)["time"] - joiner.started
                state_loaded = joiner.event("state_loaded")["time"] - joiner.started
                join_cpu = joiner.cpu_seconds(joiner.started + first_step)
            except RuntimeError:  # killed later in the churn before its first step, or still loading at the end
                first_step = state_loaded = join_cpu = None
            exited = victim.exited_at  # what the volunteer sees: the command has returned
            events.append(dict(
                kind=d["kind"], at_s=d["at"] - churn_from, peer=victim.log.stem, joiner=joiner.log.stem,
                stopped_counting_s=None if gone is None else gone - d["at"],
                coordinator_marked_left_s=None if marked is None else marked - d["at"],
                unapplied_samples=max(0, computed - applied), join_state_loaded_s=state_loaded,
                join_first_step_s=first_step, join_cpu_s=join_cpu,
                exit_s=None if exited is None else exited - d["at"],
                exit_cpu_s=victim.cpu_seconds(float("inf")) - victim.cpu_seconds(d["at"])))

        def phase(before: dict, after: dict) -> dict:
            totals = [sum(after[p][i] - before.get(p, (0, 0, 0))[i] for p in after) for i in range(3)]
            return dict(zip(("averaged", "alone", "failed"), totals))

        return dict(
            preset="demo", peers=PEERS, inner_steps=INNER_STEPS, seed=SEED, steady_s=churn_from - steady_from,
            churn_s=churn_to - churn_from, steady_samples_per_s=steady_rate, churn_samples_per_s=churn_rate,
            cpu_cores=os.cpu_count(), steady_busy_cores=(busy_steady - busy_from) / (churn_from - steady_from),
            churn_busy_cores=(busy_churn - busy_steady) / (churn_to - churn_from),
            rounds_steady=phase(rounds_start, rounds_steady),
            rounds_churn=phase(rounds_steady, rounds_end), events=events)
    finally:
        if watch is not None:
            watch.close()
        for role in reversed(roles):
            role.stop()


def _cpu_paragraph(result: dict) -> str:
    """Where the machine's CPU went during churn: the roles share its cores, so what joiners and leavers use is
    taken from the peers that train."""
    events = result["events"]
    joins = sum(e["join_cpu_s"] for e in events if e["join_cpu_s"] is not None)
    exits = sum(e["exit_cpu_s"] for e in events)
    window = result["cpu_cores"] * result["churn_s"]
    started = [e for e in events if e["join_cpu_s"] is not None and e["join_first_step_s"]]
    share = statistics.median(e["join_cpu_s"] / e["join_first_step_s"] for e in started) if started else float("nan")
    return (f"CPU: the machine's {result['cpu_cores']} cores were busy {result['steady_busy_cores']:.2f} cores on"
            f" average undisturbed and {result['churn_busy_cores']:.2f} under churn. The joiners' start-ups took"
            f" {joins:.0f} CPU seconds and the leavers' exits {exits:.0f}: {(joins + exits) / window:.0%} of the"
            f" {window:.0f} CPU seconds of the churn window, taken from the peers that train (on volunteers' own"
            " machines a joiner's start-up costs the others nothing). A joiner had a median"
            f" {share:.2f} of a core until its first step.\n\n")


def churn_section(result: dict, env: dict, out: Path) -> str:
    from benchmarks.report import measured_by, verdict

    def seconds(value: float | None) -> str:
        return "–" if value is None else f"{value:.1f}"

    events = result["events"]
    rows = "".join(
        f"| {e['at_s']:.0f} | {e['kind']} | {e['peer']} | {seconds(e['stopped_counting_s'])} |"
        f" {seconds(e['coordinator_marked_left_s'])} | {seconds(e['exit_s'])} | {seconds(e['exit_cpu_s'])} |"
        f" {e['unapplied_samples']} | {e['joiner']} | {seconds(e['join_state_loaded_s'])} |"
        f" {seconds(e['join_first_step_s'])} | {seconds(e['join_cpu_s'])} |\n" for e in events)
    ratio = result["churn_samples_per_s"] / result["steady_samples_per_s"]
    clean = [e["stopped_counting_s"] for e in events if e["kind"] == "leave"]
    killed = [e["stopped_counting_s"] for e in events if e["kind"] == "kill"]
    joins = [e["join_first_step_s"] for e in events if e["join_first_step_s"] is not None]

    def worst(values: list) -> float:
        return max((v if v is not None else float("inf")) for v in values) if values else float("nan")

    steady, churn = result["rounds_steady"], result["rounds_churn"]
    return (
        "## churn\n\n"
        f"{measured_by(env)} A coordinator and {result['peers']} peers of the `{result['preset']}` preset"
        f" (diloco, {result['inner_steps']} inner steps per round, one torch thread each) train undisturbed for"
        f" {result['steady_s']:.0f} s, then for {result['churn_s']:.0f} s a peer leaves at seeded random intervals"
        f" (seed {result['seed']}, 20-40 s apart), cleanly (SIGTERM) or killed (SIGKILL), and a new peer starts at"
        " once in its place. Samples/s: samples the peers trained up to their last completed round in each window,"
        " per second (peers' epoch events). Stops counting: seconds from the signal until hivemind's progress"
        " records, polled every 0.25 s by a DHT reader, no longer count the peer; marked left: until the coordinator's"
        " store does (a look every second). Exited: until the departed peer's command returned, and the CPU seconds"
        " its processes used from the signal on. Unapplied: samples the departed peer trained after its last round."
        " Join: seconds from the new peer's process start (about 5 s of it imports), and the CPU seconds its"
        " processes used until its first step.\n\n"
        f"| | samples/s | rounds averaged | alone | failed |\n|---|---:|---:|---:|---:|\n"
        f"| undisturbed | {result['steady_samples_per_s']:.1f} | {steady['averaged']} | {steady['alone']} |"
        f" {steady['failed']} |\n"
        f"| churn | {result['churn_samples_per_s']:.1f} ({ratio:.0%}) | {churn['averaged']} | {churn['alone']} |"
        f" {churn['failed']} |\n\n"
        "| at (s) | event | peer | stops counting (s) | marked left (s) | exited (s) | exit CPU (s) |"
        " unapplied samples | joiner | state loaded (s) | first step (s) | CPU to first step (s) |\n"
        "|---:|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|\n"
        f"{rows}\n{_cpu_paragraph(result)}"
        "Targets: a departed peer stops counting within 2 s of a clean leave "
        + verdict(worst(clean) <= 2, f"worst {worst(clean):.1f} s") + " Within 15 s of SIGKILL "
        + verdict(worst(killed) <= 15, f"worst {worst(killed):.1f} s") + " Throughput under churn at least 85% of"
        " the undisturbed swarm's " + verdict(ratio >= 0.85, f"{ratio:.0%}") + " No join over 12 s "
        + verdict(worst(joins) <= 12, f"worst {worst(joins):.1f} s") + "\n"
    )
