"""What each peer costs as the swarm grows, and joiner storms (issue 21): the scale suite of benchmarks.bench,
python -m benchmarks.bench scale [--smoke | --page] (--page: logbook/scale.md again from the newest result).

One run measures, on loopback with the demo preset (diloco, one torch thread per peer):

- costs: swarms of 2, 4 and 8 training peers, groups as large as the swarm (`--target-group-size` unset): the
  coordinator's CPU and memory (its DHT, state-holder and p2pd processes included), each peer's CPU in its
  training process and in its background processes (hivemind's DHT and averager, p2pd: where the progress,
  telemetry and run-record refreshes run; neither hivemind nor p2pd counts DHT requests or bytes for programs, so
  CPU is the measure), the time per outer round (matchmaking and all-reduce) against the group size, and the bytes
  a peer sends per round (its records' round_bytes);
- the coordinator's look with 64 and 128 lightweight publishers (benchmarks.monitor): the peers' records at counts
  that training peers cannot reach on this machine;
- a joiner storm: a coordinator that validates every epoch (so it holds the state, as in a real run) and 2 training
  peers; one joiner alone, then 8 at once. Each joiner's seconds from its process start to the state and to its first
  step, and the state downloads each holder answered (`states_served` in the coordinator's look events and in the
  peers' epoch and leaving events).

This module measures; benchmarks.bench writes the result to logbook/bench-results/bench-scale-<time>.json, and the
page from the result alone to logbook/scale.md: benchmarks.scale_fit fits and extrapolates, benchmarks.scale_page
writes the page. Tools that no role imports: this stays in benchmarks/.
"""

from __future__ import annotations

import contextlib
import signal
import statistics
import subprocess
import time
from pathlib import Path

from benchmarks.harness import Process, reached_epoch, start_coordinator, start_peer

COST_SWARMS = ((2, None), (4, None), (8, None))  # (peers, target group size; None: the whole swarm)
PUBLISHERS = (64, 128)
INNER_STEPS = 8  # a round every few seconds: many rounds in a window
WINDOW_S, SMOKE_WINDOW_S = 30.0, 8.0
PUBLISHERS_WINDOW_S = 20.0
STORM_RUNNING, STORM_JOINERS = 2, 8
SMOKE_STORM_JOINERS = 1


def stop_all(roles: list[Process]) -> None:
    """Stop every role as a user does, all at once (one by one, eleven goodbyes take a minute), then kill what is
    left after 30 s.

    Args:
        roles: the coordinator and peers started for a run, stopped or not.
    """
    for role in roles:
        if role.popen.poll() is None:
            role.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    for role in roles:
        with contextlib.suppress(subprocess.TimeoutExpired):
            role.popen.wait(max(0.1, deadline - time.monotonic()))
        role.kill()


def diloco_flags(peers: int, group: int | None = None) -> list[str]:
    """The command-line flags of a diloco swarm of the demo preset, INNER_STEPS inner steps per round.

    Args:
        peers: the swarm's training peers (its schedule is sized for them).
        group: `--target-group-size`; None: groups as large as the swarm.
    """
    from hivetrain.config import diloco_schedule_flags, get_preset

    return ["--mode", "diloco", "--inner-steps", str(INNER_STEPS), *diloco_schedule_flags(get_preset("demo"), peers),
            *(["--target-group-size", str(group)] if group else [])]


def round_counters(peer: Process, by: float) -> tuple[int, float]:
    """A peer's rounds and seconds in rounds (and state downloads after its first step) by `by`: from its last epoch
    event then (a diloco peer's epochs are its outer rounds).

    Args:
        peer: a training peer.
        by: a wall-clock time (time.time()).
    """
    epochs = [e for e in peer.events("epoch") if e["time"] <= by]
    return (epochs[-1]["epoch"], epochs[-1]["swarm_seconds"]) if epochs else (0, 0.0)


def served_by(process: Process, before: float | None = None) -> int | None:
    """The state downloads a peer had answered by `before` (its last epoch event then), or in all (its leaving
    event; None: it left none).

    Args:
        process: a peer.
        before: a wall-clock time (time.time()); None: in all, once it has left.
    """
    if before is None:
        left = process.events("left")
        return left[0].get("states_served") if left else None
    counts = [e["states_served"] for e in process.events("epoch") if e["time"] <= before and "states_served" in e]
    return counts[-1] if counts else 0


def coordinator_served(coordinator: Process, by: float) -> int:
    """The state downloads the coordinator had answered at its last look by `by`.

    Args:
        coordinator: the coordinator, looking every second.
        by: a wall-clock time (time.time()).
    """
    counts = [e["states_served"] for e in coordinator.events("look") if e["time"] <= by]
    return counts[-1] if counts else 0


def swarm_run(work: Path, name: str, peers: int, group: int | None, window_s: float, validate: bool = False,
              alone: bool = False, joiners: int = 0) -> dict:
    """A coordinator and `peers` training peers. Once every peer has taken a round (and, with `validate`, once the
    coordinator, validating every epoch, holds a state of epoch 2 as in a real run): what each costs over `window_s`
    seconds (none: 0); then, with `alone`, one joiner by itself, and with `joiners`, that many started at once: each
    one's times and the state downloads each holder answered while they joined.

    Args:
        work: the folder the roles' logs and stores go to.
        name: the run's name, the prefix of its roles' names.
        peers: the training peers.
        group: `--target-group-size`; None: groups as large as the swarm.
        window_s: seconds to measure the costs over; 0: none.
        validate: the coordinator validates every epoch (so it holds the state) rather than only monitoring.
        alone: one joiner by itself before the storm.
        joiners: the storm's joiners, started at once.
    """
    from benchmarks.harness import MONITOR_ONLY, validated_epoch
    from hivetrain.metrics_store import MetricsReader

    store = work / name / "metrics.sqlite"
    roles: list[Process] = []
    try:
        watching = ["--validate-every", "1", "--val-limit", "64", "--threads", "1"] if validate else MONITOR_ONLY
        # a look every second when joiners come: its events carry the coordinator's served downloads
        coordinator, addresses = start_coordinator(work, name, [*watching, *diloco_flags(peers, group),
                                                                *(["--refresh", "1"] if alone or joiners else [])])
        roles.append(coordinator)
        trainers = [start_peer(work, f"{name}-peer-{index}", addresses, [
            "--threads", "1", "--min-peers", str(peers), "--seed", str(index), "--progress-bar", "off"])
            for index in range(peers)]
        roles.extend(trainers)
        deadline = time.monotonic() + 180 + 30 * peers
        while min(reached_epoch(peer) for peer in trainers) < 1 or (validate and validated_epoch(store) < 2):
            if time.monotonic() > deadline or any(peer.popen.poll() is not None for peer in trainers):
                raise RuntimeError(f"the peers of {name} did not all reach a round; see {work}")
            time.sleep(0.5)
        result = dict(peers=peers, target_group_size=group, validating=validate)
        if window_s:
            started = time.time()
            time.sleep(window_s)
            ended = time.time()
            if any(peer.popen.poll() is not None for peer in trainers):
                raise RuntimeError(f"a peer of {name} stopped during the window; see {work}")
            main, descendants = coordinator.cpu_between(started, ended)
            peer_cpu = [peer.cpu_between(started, ended) for peer in trainers]
            looks = [e["seconds"] for e in coordinator.events("look") if started <= e["time"] <= ended]
            counters = [(round_counters(peer, started), round_counters(peer, ended)) for peer in trainers]
            rounds = sum(after[0] - before[0] for before, after in counters)
            round_seconds = sum(after[1] - before[1] for before, after in counters)
            inside = [e for peer in trainers for e in peer.events("epoch") if started <= e["time"] <= ended]
            groups = [e["group_size"] for e in inside if e.get("group_size")]
            sent = [e["round_bytes"] for e in inside if e.get("round_bytes") is not None]
            result.update(
                window_s=ended - started, coordinator_cores=main + descendants,
                coordinator_rss_bytes=coordinator.rss_bytes(),
                look_median_s=statistics.median(looks) if looks else None,
                peer_training_cores=statistics.mean(cpu[0] for cpu in peer_cpu),
                peer_background_cores=statistics.mean(cpu[1] for cpu in peer_cpu),
                rounds=rounds, round_seconds=round_seconds / rounds if rounds else None,
                group_size_median=statistics.median(groups) if groups else None,
                round_bytes=statistics.mean(sent) if sent else None)
            print(f"{name}: coordinator {result['coordinator_cores']:.3f} cores,"
                  f" {result['coordinator_rss_bytes'] / 2**20:.0f} MiB; per peer {result['peer_background_cores']:.3f}"
                  f" background cores; {rounds} rounds of {result['round_seconds']} s, groups of"
                  f" {result['group_size_median']}, {result['round_bytes']} bytes each", flush=True)
        if not alone and not joiners:
            return result

        def joiner(label: str, index: int) -> Process:
            peer = start_peer(work, f"{name}-{label}", addresses, ["--threads", "1", "--seed", str(index),
                                                                 "--progress-bar", "off"])
            roles.append(peer)
            return peer

        def times(peer: Process) -> dict:
            loaded = peer.wait_for_event("state_loaded", timeout=300)
            stepped = peer.wait_for_event("first_step", timeout=300)
            return dict(state_loaded_s=loaded["time"] - peer.started, first_step_s=stepped["time"] - peer.started,
                        epoch=loaded["epoch"])

        holders = list(trainers)
        if alone:
            lone = joiner("alone", peers)
            result["alone"] = times(lone)
            holders.append(lone)
            print(f"a joiner alone: state after {result['alone']['state_loaded_s']:.1f} s, first step after"
                  f" {result['alone']['first_step_s']:.1f} s", flush=True)
            lone.wait_for_event("epoch", timeout=120)  # its epoch events carry what it has served so far
        storm_from = time.time()
        before = {"coordinator": coordinator_served(coordinator, storm_from),
                  **{peer.log.stem: served_by(peer, storm_from) for peer in holders}}
        storm = [joiner(f"joiner-{index}", peers + 1 + index) for index in range(joiners)]
        storm_times = [times(peer) for peer in storm]
        storm_to = time.time()
        time.sleep(3)  # the coordinator's next look (every second) counts the storm's last downloads
        coordinator_after = coordinator_served(coordinator, time.time())
        with MetricsReader(store) as reader:  # each validation downloaded the state once, from some holder
            validations = sum(1 for row in reader.validations() if storm_from <= row.time <= storm_to + 3)
        stop_all(roles[1:])  # their leaving events say what each served in all
        served = {"coordinator": coordinator_after - before["coordinator"]}
        for peer in [*holders, *storm]:
            total = served_by(peer)
            if total is None:
                raise RuntimeError(f"{peer.log} left no leaving event with its served downloads")
            served[peer.log.stem] = total - before.get(peer.log.stem, 0)
        result.update(joiners=joiners, storm=storm_times, storm_s=storm_to - storm_from, served=served,
                      coordinator_validations=validations)
        print(f"storm of {joiners}: state after {[round(t['state_loaded_s'], 1) for t in storm_times]} s; served"
              f" {served}", flush=True)
        return result
    finally:
        stop_all(roles)


def state_sizes() -> dict:
    """Parameters of the demo and mission models, and the bytes of a diloco state download (outer parameters and
    momentum) at each preset's state compression."""
    import dataclasses

    from hivetrain.config import DEFAULT_PRESET, get_preset
    from hivetrain.model import create_model

    sizes = {}
    for preset in ("demo", DEFAULT_PRESET):
        config = get_preset(preset)
        model = create_model(dataclasses.replace(config.model, pretrained=False))
        parameters = sum(p.numel() for p in model.parameters())
        per_value = {"fp16": 2, "8bit": 1}.get(config.swarm.state_compression, 4)
        sizes[preset] = dict(parameters=parameters, state_bytes=2 * parameters * per_value,
                             state_compression=config.swarm.state_compression,
                             averaging_timeout_s=config.swarm.averaging_timeout)
    return sizes


def scale_suite(work: Path, smoke: bool) -> dict:
    """The scale suite's result for benchmarks.bench: the storm, the cost swarms and the publishers' runs, and the
    models' sizes (benchmarks.scale_page writes the page from it).

    Args:
        work: the folder the runs' logs and stores go to.
        smoke: one swarm of STORM_RUNNING peers only, its costs and one joiner: a quick check, not the page's numbers.
    """
    from benchmarks.monitor import monitor_run

    if smoke:  # one swarm, its coordinator only monitoring (it holds no state): its costs, then one joiner
        storm = swarm_run(work, "storm", STORM_RUNNING, None, SMOKE_WINDOW_S, joiners=SMOKE_STORM_JOINERS)
        costs, publishers = [storm], []
    else:
        # the storm first: it is what this benchmark exists for, and the machine is quietest at the start
        storm = swarm_run(work, "storm", STORM_RUNNING, None, 0, validate=True, alone=True, joiners=STORM_JOINERS)
        costs = [swarm_run(work, f"costs-{peers}" + (f"-g{group}" if group else ""), peers, group, WINDOW_S)
                 for peers, group in COST_SWARMS]
        publishers = []
        for count in PUBLISHERS:
            try:
                publishers.append(monitor_run(work, count, PUBLISHERS_WINDOW_S))
            except RuntimeError as e:  # e.g. a publisher's bootstrap unanswered on a loaded machine: the page says so
                publishers.append(dict(publishers=count, error=str(e)))
    return dict(preset="demo", inner_steps=INNER_STEPS, costs=costs, publishers=publishers, storm=storm,
                models=state_sizes())
