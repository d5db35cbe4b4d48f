"""What each peer costs as the swarm grows, and joiner storms (issue 21): the scale suite of benchmarks.bench,
python -m benchmarks.bench scale [--smoke | --page] (--page: logbook/scale.md again from the newest record).

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

benchmarks.bench writes the record to logbook/bench-records/bench-scale-<time>.json and the page, which scale_page
fits and extrapolates from it, to logbook/scale.md. Tools that no role imports: this stays in benchmarks/.
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
    left after 30 s."""
    for role in roles:
        if role.popen.poll() is None:
            role.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    for role in roles:
        with contextlib.suppress(subprocess.TimeoutExpired):
            role.popen.wait(max(0.1, deadline - time.monotonic()))
        role.kill()


def diloco_flags(peers: int, group: int | None = None) -> list[str]:
    from hivetrain.config import diloco_schedule_flags, get_preset

    return ["--mode", "diloco", "--inner-steps", str(INNER_STEPS), *diloco_schedule_flags(get_preset("demo"), peers),
            *(["--target-group-size", str(group)] if group else [])]


def round_counters(peer: Process, by: float) -> tuple[int, float]:
    """A peer's rounds and seconds in rounds (and state downloads after its first step) by `by`: from its last epoch
    event then (a diloco peer's epochs are its outer rounds)."""
    epochs = [e for e in peer.events("epoch") if e["time"] <= by]
    return (epochs[-1]["epoch"], epochs[-1]["swarm_seconds"]) if epochs else (0, 0.0)


def served_by(process: Process, before: float | None = None) -> int | None:
    """The state downloads a peer had answered by `before` (its last epoch event then), or in all (its leaving
    event)."""
    if before is None:
        left = process.events("left")
        return left[0].get("states_served") if left else None
    counts = [e["states_served"] for e in process.events("epoch") if e["time"] <= before and "states_served" in e]
    return counts[-1] if counts else 0


def coordinator_served(coordinator: Process, by: float) -> int:
    """The state downloads the coordinator had answered at its last look by `by`."""
    counts = [e["states_served"] for e in coordinator.events("look") if e["time"] <= by]
    return counts[-1] if counts else 0


def swarm_run(work: Path, name: str, peers: int, group: int | None, window_s: float, validate: bool = False,
              alone: bool = False, joiners: int = 0) -> dict:
    """A coordinator and `peers` training peers. Once every peer has taken a round (and, with `validate`, once the
    coordinator, validating every epoch, holds a state of epoch 2 as in a real run): what each costs over `window_s`
    seconds (none: 0); then, with `alone`, one joiner by itself, and with `joiners`, that many started at once: each
    one's times and the state downloads each holder answered while they joined."""
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


# The page ------------------------------------------------------------------------------------------------------------

SIZES = (100, 1_000, 10_000)
REFRESH_S = 10.0  # the coordinator's default --refresh: a look slower than this falls behind the swarm
VOLUNTEER_BACKGROUND_CORES = 0.5  # a volunteer's machine gives the swarm's upkeep at most half a core (assumption)
COORDINATOR_CORES = 1.0  # the coordinator's look runs on one thread
JOIN_FRACTION = 0.1  # a storm: a tenth of the swarm joins at once (assumption: a restart, a class starting together)
REACHABLE_FRACTION = 0.5  # peers that are not in client mode and so can serve the state (assumption)
UPLINK_BYTES_S = 20e6 / 8  # a holder's uplink, 20 Mbit/s (the links suite's volunteer line)
PUBLISHERS_LOOK_EVERY_S = 2.0  # benchmarks.monitor's coordinator looks every 2 s
PROGRESS_READ_EVERY_S = 3.0  # hivemind's progress tracker reads the records every 0.5-10 s, 3 by default (assumption)
STORM_WAIT_S = 600.0  # a joiner should not wait over 10 minutes for the state (assumption)


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = a + b x; (a, b)."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    if len(set(xs)) < 2:
        return ys[0], 0.0
    slope, intercept = statistics.linear_regression(xs, ys)
    return intercept, slope


def growing(points: list[tuple[float, float]]) -> tuple[float, float, bool]:
    """fit(points), unless the cost fell as N grew (the shared machine gave each process less, not a trend to
    extrapolate): then the value at the smallest N, held constant. (a, b, whether it fell)."""
    if not points:
        return float("nan"), 0.0, False
    a, b = fit(points)
    if b < 0:
        return min(points)[1], 0.0, True
    return a, b, False


def crossing(a: float, b: float, limit: float) -> float | None:
    """The x at which a + b x reaches `limit` (None: never, it does not grow)."""
    if a >= limit:
        return 0.0
    return (limit - a) / b if b > 0 else None


def _number(value: float, digits: int = 3) -> str:
    return f"{value:,.{digits}f}" if abs(value) < 1e4 else f"{value:,.0f}"


def scale_page(result: dict, env: dict, out: Path) -> str:
    """The whole of logbook/scale.md from a record's result: benchmarks.bench's renderer for the scale suite (`env`
    names the command that measured it and the record's path; the page has no plots for `out`)."""
    costs, storm, models = result["costs"], result["storm"], result["models"]
    whole = [c for c in costs if c["target_group_size"] is None]  # groups as large as the swarm

    def maybe(value: float | None, digits: int, scale: float = 1.0) -> str:
        return "" if value is None else f"{value / scale:.{digits}f}"

    validating = ("validates every epoch" if costs[0]["validating"] else "only monitors (a look every 10 s)")
    cost_rows = "".join(
        f"| {c['peers']} | {c['target_group_size'] or ''} | {maybe(c['group_size_median'], 0)} |"
        f" {c['coordinator_cores']:.3f} | {c['coordinator_rss_bytes'] / 2**20:.0f} | {maybe(c['look_median_s'], 3)} |"
        f" {c['peer_training_cores']:.3f} | {c['peer_background_cores']:.3f} |"
        f" {c['coordinator_cores'] + c['peers'] * (c['peer_training_cores'] + c['peer_background_cores']):.2f} |"
        f" {c['rounds']} |"
        f" {maybe(c['round_seconds'], 2)} | {maybe(c['round_bytes'], 0, 1e3)} |\n" for c in costs)
    failed = [p for p in result["publishers"] if "error" in p]
    result = dict(result, publishers=[p for p in result["publishers"] if "error" not in p])
    publisher_failures = "".join(f"With {p['publishers']} publishers the run failed: {p['error']}\n\n"
                                 for p in failed)
    publisher_rows = "".join(
        f"| {p['publishers']} | {p['look_median_s']:.3f} | {p['look_max_s']:.3f} | {p['counted_median']:.0f} |"
        f" {p['coordinator_cpu_percent'] / 100:.3f} | {p['coordinator_rss_bytes'] / 2**20:.0f} |\n"
        for p in result["publishers"])

    # Fits. The coordinator's CPU from the publishers where measured: its look then costs what N peers' records cost
    # (the training swarms' coordinators shared two saturated cores with the peers, and looked five times less often).
    coordinator_points = [(p["publishers"], p["coordinator_cpu_percent"] / 100) for p in result["publishers"]] or [
        (c["peers"], c["coordinator_cores"]) for c in whole]
    # The look's time likewise: in the training swarms it waited for saturated cores.
    look_points = [(p["publishers"], p["look_median_s"]) for p in result["publishers"]] or [
        (c["peers"], c["look_median_s"]) for c in whole if c["look_median_s"] is not None]
    rss_points = [(c["peers"], c["coordinator_rss_bytes"] / 2**20) for c in whole] + [
        (p["publishers"], p["coordinator_rss_bytes"] / 2**20) for p in result["publishers"]]
    background_points = [(c["peers"], c["peer_background_cores"]) for c in whole]
    # A round against its group only where the group formed as asked: a swarm whose rounds fell apart (groups
    # smaller than asked for) measures the saturated machine, not the group size.
    formed = [c for c in costs if c["round_seconds"] is not None and c["group_size_median"] is not None
              and c["group_size_median"] >= (c["target_group_size"] or c["peers"])]
    fell_apart = [c for c in costs if c not in formed and c["round_seconds"] is not None]
    round_points = [(c["group_size_median"], c["round_seconds"]) for c in formed]
    fits = {name: growing(points) for name, points in dict(
        coordinator_cores=coordinator_points, look_s=look_points, rss_mib=rss_points,
        background_cores=background_points, round_s=round_points).items()}
    # A peer's background work as N grows, modelled: its progress tracker reads all N progress records about every
    # PROGRESS_READ_EVERY_S, at the coordinator's measured cost per record read (its look every 2 s reads each
    # peer's records): the measured fit alone cannot show it, the machine gave the peers less as they multiplied.
    background_model_slope = fits["coordinator_cores"][1] * PUBLISHERS_LOOK_EVERY_S / PROGRESS_READ_EVERY_S
    demo, mission = models["demo"], models[next(k for k in models if k != "demo")]
    mission_name = next(k for k in models if k != "demo")

    # The joiner storm: the largest share of its downloads one holder answered, and what that share of a storm of
    # JOIN_FRACTION x N joiners costs the busiest holder's uplink with the mission model's state.
    served = storm["served"]
    storm_downloads = sum(served.values())
    busiest = max(served, key=served.get)
    busiest_share = served[busiest] / storm_downloads if storm_downloads else 1.0
    holders = sum(1 for count in served.values() if count > 0)

    def storm_seconds(size: int, share: float) -> float:
        return JOIN_FRACTION * size * share * mission["state_bytes"] / UPLINK_BYTES_S

    limits = {
        "the coordinator's look (one look slower than the refresh)": (
            crossing(*fits["look_s"][:2], REFRESH_S), f"a look takes {REFRESH_S:.0f} s (`--refresh`)",
            "a longer `--refresh`; beyond that, a look that reads only records changed since the last (a design"
            " change: hivemind's DHT returns every subkey of the metrics and progress keys each time)"),
        "the coordinator's CPU": (
            crossing(*fits["coordinator_cores"][:2], COORDINATOR_CORES), f"{COORDINATOR_CORES:.0f} core",
            "the same as the look: fewer, incremental reads; the validation runs on a machine of its own"),
        "each peer's background work (the DHT refreshes, and its rounds' networking)": (
            crossing(fits["background_cores"][0], background_model_slope, VOLUNTEER_BACKGROUND_CORES),
            f"{VOLUNTEER_BACKGROUND_CORES} core of background work per peer",
            "longer refresh periods (the progress tracker's and `PUBLISH_EVERY`), and each peer reading a bounded"
            " sample of the progress records rather than all N (a design change in the round trigger)"),
        "all-reduce fan-in (one group of the whole swarm)": (
            crossing(*fits["round_s"][:2], demo["averaging_timeout_s"]),
            f"a round takes the demo preset's averaging timeout, {demo['averaging_timeout_s']:.0f} s",
            "`--target-group-size` (groups of G, drawn anew each round): the round then costs what a group of G"
            " costs, at any N"),
        "a joiner storm on the state holders": (
            STORM_WAIT_S / (JOIN_FRACTION * busiest_share * mission["state_bytes"] / UPLINK_BYTES_S),
            f"the busiest holder needs over {STORM_WAIT_S / 60:.0f} minutes to send its share",
            "more holders: every reachable peer serves at the same priority (hivemind draws at random among the"
            " newest), so the share per holder is 1 / holders; the coordinator with a faster uplink"),
    }

    def first_limits(size: int) -> str:
        hit = sorted((at, what) for what, (at, _, _) in limits.items() if at is not None and at <= size)
        return "none of those modelled" if not hit else "; ".join(f"{what} (from about {at:,.0f} peers)"
                                                                  for at, what in hit)

    (a, b, _), (la, lb, _), (ra, rb, _) = fits["coordinator_cores"], fits["look_s"], fits["rss_mib"]
    (ba, _, _), (oa, ob, _) = fits["background_cores"], fits["round_s"]

    def fit_row(what: str, name: str, points: list, digits: int) -> str:
        fa, fb, fell = fits[name]
        note = " (fell as N grew: held at the smallest N's value)" if fell else ""
        return (f"| {what} | {fa:.{digits}f} | {fb:.{digits + 2}f}{note} | {len(points)} sizes, N ="
                f" {', '.join(f'{x:g}' for x, _ in points)} |\n")
    extrapolated = "".join(
        f"| {size:,} | {_number(a + b * size)} | {_number(la + lb * size)} | {_number(ra + rb * size, 0)} |"
        f" {_number(ba + background_model_slope * size)} | {_number(oa + ob * size, 1)} |"
        f" {_number(storm_seconds(size, busiest_share), 0)}"
        f" | {_number(storm_seconds(size, 1 / (REACHABLE_FRACTION * size)), 1)} | {first_limits(size)} |\n"
        for size in SIZES)
    limit_rows = "".join(
        f"| {what} | {condition} | {'never (it does not grow)' if at is None else f'{at:,.0f}'} | {lift} |\n"
        for what, (at, condition, lift) in limits.items())
    storm_rows = "".join(
        f"| {index} | {t['epoch']} | {t['state_loaded_s']:.1f} | {t['first_step_s']:.1f} |\n"
        for index, t in enumerate(storm["storm"]))
    served_rows = "".join(f"| {holder} | {count} |\n" for holder, count in served.items())
    loaded = [t["state_loaded_s"] for t in storm["storm"]]
    storm_coordinator, storm_ready = (
        ("validates every epoch (so that, as in a real run, it holds the newest state and serves it)",
         "the coordinator has validated epoch 2") if storm["validating"] else
        ("only monitors (so it holds no state and serves none: a smoke run)", "every peer has taken a round"))
    if "alone" in storm:
        alone = storm["alone"]
        alone_line = (f"Alone: state after {alone['state_loaded_s']:.1f} s, first step after"
                      f" {alone['first_step_s']:.1f} s.")
        against_alone = f" against {alone['state_loaded_s']:.1f} s alone"
    else:
        alone_line, against_alone = "No joiner alone in this run.", ""
    from_coordinator = served.get("coordinator", 0)

    return (
        "# Scale: what each peer costs, and joiner storms\n\n"
        f"Written by `{env['command']}` from the record `{env['record']}`: measured on {env['date']} at commit"
        f" {env['commit']} ({env['machine']}; Python {env['python']}, torch {env['torch']}, hivemind"
        f" {env['hivemind']}). Measured on a 2-core machine that every peer, the coordinator and the publishers"
        " share: CPU and time figures at the larger N measure the machine as much as the swarm."
        " All traffic is on loopback. `python -m benchmarks.bench scale --page` rebuilds this page from the newest"
        " record.\n\n"
        "## Measured: swarms of training peers\n\n"
        f"A coordinator that {validating} and N peers of the `{result['preset']}` preset"
        f" ({demo['parameters']:,} parameters), diloco with {result['inner_steps']} inner steps per round, one torch"
        f" thread each, over {costs[0]['window_s']:.0f} s once every peer has taken a round. Coordinator: CPU (cores)"
        " and memory of its process tree (its DHT, state-holder and p2pd processes). Per peer, mean over the peers:"
        " CPU of its training process, and of its background processes (hivemind's DHT and averager, p2pd: the"
        " progress, telemetry and run-record refreshes and the rounds' networking). DHT requests and bytes are not"
        " counted: neither hivemind 1.1.12 nor p2pd exposes them to programs, so background CPU stands for them."
        " A round: its peers' seconds in outer rounds (matchmaking and all-reduce; their records' swarm_seconds) per"
        " round in the window (from their epoch events; a diloco epoch is a round). Group: the peers its rounds"
        " averaged, itself included, median over the window. Bytes per round: what a peer sends in"
        " one, its records' round_bytes, hivemind's butterfly all-reduce estimated as 2 (G - 1) / G x the parameters"
        " x 4 bytes (not counted on the wire). All cores: the coordinator's and every peer's together; where it"
        " nears 2 the machine is saturated, and the per-peer figures are what each peer got, not what it would"
        " take: CPU per peer and a round's time at the larger sizes measure the machine as much as the swarm.\n\n"
        "| peers | `--target-group-size` | group, median | coordinator cores | coordinator RSS (MiB) | a look (s) |"
        " training cores per peer | background cores per peer | all cores | rounds | a round (s) |"
        " kB per round per peer |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
        f"{cost_rows}\n"
        "## Measured: the coordinator's look with lightweight publishers\n\n"
        "Training peers fill the two cores long before the coordinator's look costs much, so here N DHT-only"
        " publishers (`benchmarks/publishers.py`) store the metrics and progress records that N peers would, each"
        f" signed with its own key; a look every 2 s, over {PUBLISHERS_WINDOW_S:.0f} s.\n\n"
        "| publishers | a look, median (s) | slowest look (s) | counted, median | coordinator cores |"
        " coordinator RSS (MiB) |\n|---:|---:|---:|---:|---:|---:|\n"
        f"{publisher_rows}\n{publisher_failures}"
        "## Measured: a joiner storm\n\n"
        f"A coordinator that {storm_coordinator} and {storm['peers']} training peers; once {storm_ready},"
        f"{' one joiner alone, then' if 'alone' in storm else ''} {storm['joiners']} joiner(s) started at once."
        " Seconds from each joiner's process start (imports included, on cores all of them share). Downloads"
        " answered: per holder, during the storm, from its own counter (`states_served`, counted where hivemind"
        " asks the host process for the state it sends), read from the coordinator's look events and the peers'"
        " epoch and leaving events.\n\n"
        f"{alone_line}\n\n"
        "| joiner | joined at epoch | state loaded (s) | first step (s) |\n|---:|---:|---:|---:|\n"
        f"{storm_rows}\n"
        "| holder | downloads answered in the storm |\n|---|---:|\n"
        f"{served_rows}\n"
        f"{storm_downloads} downloads answered for {storm['joiners']} joiners (the coordinator also downloaded the"
        f" state {storm['coordinator_validations']} time(s) in that time for its validations, from one of the others,"
        f" and a download that failed part-way is answered again by the next holder); {holders} holder(s) answered"
        f" any; the coordinator answered {from_coordinator} ({from_coordinator / max(storm_downloads, 1):.0%}), the"
        f" busiest holder, {busiest}, {served[busiest]} ({busiest_share:.0%}). The storm's state loads took"
        f" {min(loaded):.1f}-{max(loaded):.1f} s{against_alone}.\n\n"
        "Why they spread: hivemind's `load_state_from_peers` reads every holder's declared `state_sharing_priority`"
        " and asks them in descending order, breaking ties at random. Peers declare their outer round as their"
        " priority after every round and every download, and the coordinator declares the round of the state it last"
        " downloaded, so joiners pick at random among the holders of the newest round: the coordinator is one holder"
        " among several, not the one every joiner asks. When the coordinator lags a round (it downloads only to"
        " validate), the peers come first; when every peer is in client mode (no reachable peer can serve), only the"
        " coordinator remains. This spreading is hivemind's own (no change was made to it); the table above is how"
        " this run's storm went.\n\n"
        "## Fits\n\n"
        "Straight lines y = a + b N by least squares: the coordinator's CPU and its look's time from the publishers"
        " where measured (a look every 2 s, five times as often as its default: an upper bound; in the training"
        " swarms the look waited for saturated cores), its memory from the training swarms and the publishers"
        " together, a peer's background CPU from the training swarms, a round's time against its group size G from"
        " the swarms whose groups formed as asked. A cost that fell as N grew is not a trend (the shared machine gave"
        " each process less): it is held at its value at the smallest N, a lower bound.\n\n"
        "| cost | a | b (per peer) | from |\n|---|---:|---:|---|\n"
        + fit_row("coordinator cores", "coordinator_cores", coordinator_points, 4)
        + fit_row("a look (s)", "look_s", look_points, 4)
        + fit_row("coordinator RSS (MiB)", "rss_mib", rss_points, 1)
        + fit_row("background cores per peer", "background_cores", background_points, 4)
        + fit_row("a round (s), against G", "round_s", round_points, 3)
        + f"\nModelled, not fitted: a peer's background cores grow by {background_model_slope:.6f} per peer (its"
        f" progress tracker reads all N progress records about every {PROGRESS_READ_EVERY_S:.0f} s, at the"
        f" coordinator's measured cost per record read, {b:.6f} cores per peer at a read every"
        f" {PUBLISHERS_LOOK_EVERY_S:.0f} s); the extrapolation below adds this to the measured value."
        + "".join(f" With {c['peers']} peers the groups fell short of the whole swarm (median group"
                  f" {c['group_size_median']:g}, a round {c['round_seconds']:.1f} s): on two cores shared by all of"
                  " them, peers missed the matchmaking window or timed out, so that swarm's round is left out of the"
                  " fit." for c in fell_apart)
        + "\n\n"
        "## Extrapolated to 100, 1,000 and 10,000 peers\n\n"
        "**Everything in this section is extrapolated from the fits above, not measured.** Assumptions:\n\n"
        "- every cost grows in a straight line with N as it did over the sizes measured (the coordinator's up to the"
        " most publishers, a round's up to the largest group that formed); a peer's background work as modelled"
        " above;\n"
        f"- a round with one group of the whole swarm (no `--target-group-size`): G = N; the demo model"
        f" ({demo['parameters']:,} parameters) on loopback. Bytes per round per peer stay below 2 x the parameters x 4"
        f" bytes ({2 * demo['parameters'] * 4 / 1e6:.2f} MB for the demo model) at any G: they do not limit;\n"
        f"- the limits: a look slower than the coordinator's refresh ({REFRESH_S:.0f} s); the coordinator above"
        f" {COORDINATOR_CORES:.0f} core (its look is one thread); a volunteer giving the swarm's upkeep more than"
        f" {VOLUNTEER_BACKGROUND_CORES} core; a round longer than the preset's averaging timeout"
        f" ({demo['averaging_timeout_s']:.0f} s), when it is abandoned;\n"
        f"- a joiner storm: {JOIN_FRACTION:.0%} of the swarm joins at once; each downloads the {mission_name}"
        f" preset's state ({mission['parameters']:,} parameters, outer parameters and momentum at"
        f" {mission['state_compression']}: {mission['state_bytes'] / 1e6:.0f} MB) over holders' uplinks of"
        f" {UPLINK_BYTES_S * 8 / 1e6:.0f} Mbit/s. Measured spread: the busiest holder answers {busiest_share:.0%} of"
        f" the downloads, as in the storm above (with {holders} holders); spread over every reachable peer"
        f" ({REACHABLE_FRACTION:.0%} of them, an assumption) it answers 1 / ({REACHABLE_FRACTION} N). The limit: the"
        f" busiest holder needs over {STORM_WAIT_S / 60:.0f} minutes to send its share (its last joiner waits that"
        " long).\n\n"
        "| peers | coordinator cores | a look (s) | coordinator RSS (MiB) | background cores per peer | a round,"
        " G = N (s) | storm: busiest holder, if the holders stay as few as measured (s) | storm: spread over"
        " reachable peers (s) | limits reached |\n|---:|---:|---:|---:|---:|---:|---:|---:|---|\n"
        f"{extrapolated}\n"
        "## Each limit, where it comes, and what lifts it\n\n"
        "| limit | reached when | from about N peers (extrapolated) | what lifts it |\n|---|---|---:|---|\n"
        f"{limit_rows}"
    )
