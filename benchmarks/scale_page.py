"""The scale suite's page, logbook/scale.md (issue 21): what benchmarks.scale measured, and the fits and
extrapolation benchmarks.scale_fit makes of it, one function per section of the page.

benchmarks.bench renders it with scale_page from a bench result alone, after a run or with
python -m benchmarks.bench scale --page (from the newest result). Tools that no role imports: this stays in
benchmarks/.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.relay import GIGABIT_BYTES_S, ROUND_EVERY_S, relay_capacity
from benchmarks.harness import ROOT
from benchmarks.report import newest_result
from benchmarks.scale import PUBLISHERS_WINDOW_S
from benchmarks.scale_fit import (COORDINATOR_CORES, JOIN_FRACTION, PROGRESS_READ_EVERY_S, PUBLISHERS_LOOK_EVERY_S,
                                  REACHABLE_FRACTION, REFRESH_S, SIZES, STORM_WAIT_S, UPLINK_BYTES_S,
                                  VOLUNTEER_BACKGROUND_CORES, CostFits, Limit, StormSpread, first_limits, fit_costs,
                                  mission_model, scale_limits, storm_seconds, storm_spread)


def _number(value: float, digits: int = 3) -> str:
    """An extrapolated table cell: `digits` decimals, none from 10,000 up (there they only add noise)."""
    return f"{value:,.{digits}f}" if abs(value) < 1e4 else f"{value:,.0f}"


def _optional_number(value: float | None, digits: int, scale: float = 1.0) -> str:
    """A table cell: `value` / `scale`, or empty where it was not measured."""
    return "" if value is None else f"{value / scale:.{digits}f}"


def header_section(env: dict) -> str:
    """The page's title, and what measured it, where and how (the paragraph under the title).

    Args:
        env: the bench result's environment, with the command that measured it and the result's path.
    """
    return (
        "# Scale: what each peer costs, and joiner storms\n\n"
        f"Written by `{env['command']}` from the bench result `{env['result_file']}`: measured on {env['date']} at"
        f" commit {env['commit']} ({env['machine']}; Python {env['python']}, torch {env['torch']}, hivemind"
        f" {env['hivemind']}). Measured on a 2-core machine that every peer, the coordinator and the publishers"
        " share: CPU and time figures at the larger N measure the machine as much as the swarm."
        " All traffic is on loopback. `python -m benchmarks.bench scale --page` rebuilds this page from the newest"
        " result (and the relay suite's newest, for the last section).\n\n")


def swarms_section(result: dict) -> str:
    """The section "Measured: swarms of training peers": each swarm's costs, a row per swarm.

    Args:
        result: the bench result's `result`.
    """
    costs, demo = result["costs"], result["models"]["demo"]
    validating = ("validates every epoch" if costs[0]["validating"] else "only monitors (a look every 10 s)")
    cost_rows = "".join(
        f"| {c['peers']} | {c['target_group_size'] or ''} | {_optional_number(c['group_size_median'], 0)} |"
        f" {c['coordinator_cores']:.3f} | {c['coordinator_rss_bytes'] / 2**20:.0f} |"
        f" {_optional_number(c['look_median_s'], 3)} |"
        f" {c['peer_training_cores']:.3f} | {c['peer_background_cores']:.3f} |"
        f" {c['coordinator_cores'] + c['peers'] * (c['peer_training_cores'] + c['peer_background_cores']):.2f} |"
        f" {c['rounds']} |"
        f" {_optional_number(c['round_seconds'], 2)} | {_optional_number(c['round_bytes'], 0, 1e3)} |\n"
        for c in costs)
    return (
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
        f"{cost_rows}\n")


def publishers_section(publishers: list[dict]) -> str:
    """The section "Measured: the coordinator's look with lightweight publishers": a row per run, then the runs that
    failed.

    Args:
        publishers: the bench result's runs of publishers, failed ones (with an `error`) included.
    """
    publisher_rows = "".join(
        f"| {p['publishers']} | {p['look_median_s']:.3f} | {p['look_max_s']:.3f} | {p['counted_median']:.0f} |"
        f" {p['coordinator_cpu_percent'] / 100:.3f} | {p['coordinator_rss_bytes'] / 2**20:.0f} |\n"
        for p in publishers if "error" not in p)
    publisher_failures = "".join(f"With {p['publishers']} publishers the run failed: {p['error']}\n\n"
                                 for p in publishers if "error" in p)
    return (
        "## Measured: the coordinator's look with lightweight publishers\n\n"
        "Training peers fill the two cores long before the coordinator's look costs much, so here N DHT-only"
        " publishers (`benchmarks/publishers.py`) store the metrics and progress records that N peers would, each"
        f" signed with its own key; a look every 2 s, over {PUBLISHERS_WINDOW_S:.0f} s.\n\n"
        "| publishers | a look, median (s) | slowest look (s) | counted, median | coordinator cores |"
        " coordinator RSS (MiB) |\n|---:|---:|---:|---:|---:|---:|\n"
        f"{publisher_rows}\n{publisher_failures}")


def storm_section(storm: dict, spread: StormSpread) -> str:
    """The section "Measured: a joiner storm": the joiner alone, each storm joiner's times, the downloads each holder
    answered, and why they spread as they did.

    Args:
        storm: the bench result's storm run.
        spread: how its downloads spread.
    """
    storm_rows = "".join(
        f"| {index} | {t['epoch']} | {t['state_loaded_s']:.1f} | {t['first_step_s']:.1f} |\n"
        for index, t in enumerate(storm["storm"]))
    served_rows = "".join(f"| {holder} | {count} |\n" for holder, count in spread.served.items())
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
    from_coordinator = spread.served.get("coordinator", 0)
    return (
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
        f"{spread.downloads} downloads answered for {storm['joiners']} joiners (the coordinator also downloaded the"
        f" state {storm['coordinator_validations']} time(s) in that time for its validations, from one of the others,"
        f" and a download that failed part-way is answered again by the next holder); {spread.holders} holder(s)"
        f" answered any; the coordinator answered {from_coordinator}"
        f" ({from_coordinator / max(spread.downloads, 1):.0%}), the busiest holder, {spread.busiest},"
        f" {spread.served[spread.busiest]} ({spread.busiest_share:.0%}). The storm's state loads took"
        f" {min(loaded):.1f}-{max(loaded):.1f} s{against_alone}.\n\n"
        "Why they spread: hivemind's `load_state_from_peers` reads every holder's declared `state_sharing_priority`"
        " and asks them in descending order, breaking ties at random. Peers declare their outer round as their"
        " priority after every round and every download, and the coordinator declares the round of the state it last"
        " downloaded, so joiners pick at random among the holders of the newest round: the coordinator is one holder"
        " among several, not the one every joiner asks. When the coordinator lags a round (it downloads only to"
        " validate), the peers come first; when every peer is in client mode (no reachable peer can serve), only the"
        " coordinator remains. This spreading is hivemind's own (no change was made to it); the table above is how"
        " this run's storm went.\n\n")


def fits_section(fits: CostFits) -> str:
    """The section "Fits": each cost's line and the points it was fitted to, and the modelled background work.

    Args:
        fits: the fitted costs.
    """
    def fit_row(what: str, name: str, digits: int) -> str:
        a, b, fell = fits.lines[name]
        note = " (fell as N grew: held at the smallest N's value)" if fell else ""
        return (f"| {what} | {a:.{digits}f} | {b:.{digits + 2}f}{note} | {len(fits.points[name])} sizes, N ="
                f" {', '.join(f'{x:g}' for x, _ in fits.points[name])} |\n")

    return (
        "## Fits\n\n"
        "Straight lines y = a + b N by least squares: the coordinator's CPU and its look's time from the publishers"
        " where measured (a look every 2 s, five times as often as its default: an upper bound; in the training"
        " swarms the look waited for saturated cores), its memory from the training swarms and the publishers"
        " together, a peer's background CPU from the training swarms, a round's time against its group size G from"
        " the swarms whose groups formed as asked. A cost that fell as N grew is not a trend (the shared machine gave"
        " each process less): it is held at its value at the smallest N, a lower bound.\n\n"
        "| cost | a | b (per peer) | from |\n|---|---:|---:|---|\n"
        + fit_row("coordinator cores", "coordinator_cores", 4)
        + fit_row("a look (s)", "look_s", 4)
        + fit_row("coordinator RSS (MiB)", "rss_mib", 1)
        + fit_row("background cores per peer", "background_cores", 4)
        + fit_row("a round (s), against G", "round_s", 3)
        + f"\nModelled, not fitted: a peer's background cores grow by {fits.background_model_slope:.6f} per peer"
        f" (its progress tracker reads all N progress records about every {PROGRESS_READ_EVERY_S:.0f} s, at the"
        f" coordinator's measured cost per record read, {fits.lines['coordinator_cores'][1]:.6f} cores per peer at a"
        f" read every {PUBLISHERS_LOOK_EVERY_S:.0f} s); the extrapolation below adds this to the measured value."
        + "".join(f" With {c['peers']} peers the groups fell short of the whole swarm (median group"
                  f" {c['group_size_median']:g}, a round {c['round_seconds']:.1f} s): on two cores shared by all of"
                  " them, peers missed the matchmaking window or timed out, so that swarm's round is left out of the"
                  " fit." for c in fits.fell_apart)
        + "\n\n")


def extrapolation_section(models: dict, fits: CostFits, spread: StormSpread, limits: dict[str, Limit]) -> str:
    """The section "Extrapolated to 100, 1,000 and 10,000 peers": its assumptions, and a row of costs per size.

    Args:
        models: the bench result's state_sizes(), by preset.
        fits: the fitted costs.
        spread: how the storm's downloads spread.
        limits: scale_limits().
    """
    demo, (mission_name, mission) = models["demo"], mission_model(models)
    lines = fits.lines
    (a, b, _), (la, lb, _), (ra, rb, _) = lines["coordinator_cores"], lines["look_s"], lines["rss_mib"]
    (ba, _, _), (oa, ob, _) = lines["background_cores"], lines["round_s"]
    extrapolated = "".join(
        f"| {size:,} | {_number(a + b * size)} | {_number(la + lb * size)} | {_number(ra + rb * size, 0)} |"
        f" {_number(ba + fits.background_model_slope * size)} | {_number(oa + ob * size, 1)} |"
        f" {_number(storm_seconds(size, spread.busiest_share, mission['state_bytes']), 0)}"
        f" | {_number(storm_seconds(size, 1 / (REACHABLE_FRACTION * size), mission['state_bytes']), 1)} |"
        f" {first_limits(limits, size)} |\n"
        for size in SIZES)
    return (
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
        f" {UPLINK_BYTES_S * 8 / 1e6:.0f} Mbit/s. Measured spread: the busiest holder answers"
        f" {spread.busiest_share:.0%} of the downloads, as in the storm above (with {spread.holders} holders); spread"
        f" over every reachable peer ({REACHABLE_FRACTION:.0%} of them, an assumption) it answers 1 /"
        f" ({REACHABLE_FRACTION} N). The limit: the busiest holder needs over {STORM_WAIT_S / 60:.0f} minutes to send"
        " its share (its last joiner waits that long).\n\n"
        "| peers | coordinator cores | a look (s) | coordinator RSS (MiB) | background cores per peer | a round,"
        " G = N (s) | storm: busiest holder, if the holders stay as few as measured (s) | storm: spread over"
        " reachable peers (s) | limits reached |\n|---:|---:|---:|---:|---:|---:|---:|---:|---|\n"
        f"{extrapolated}\n")


def limits_section(limits: dict[str, Limit]) -> str:
    """The section "Each limit, where it comes, and what lifts it": a row per limit.

    Args:
        limits: scale_limits().
    """
    limit_rows = "".join(
        f"| {what} | {limit.condition} | {'never (it does not grow)' if limit.at is None else f'{limit.at:,.0f}'} |"
        f" {limit.lift} |\n"
        for what, limit in limits.items())
    return (
        "## Each limit, where it comes, and what lifts it\n\n"
        "| limit | reached when | from about N peers (extrapolated) | what lifts it |\n|---|---|---:|---|\n"
        f"{limit_rows}")


def relay_cost_section(path: Path) -> str:
    """The section "The coordinator as a relay": the relay suite's bench result at `path` (benchmarks.relay), what it
    measured and how many unreachable trainers one coordinator serves at the mission's model.

    Args:
        path: a bench result of the relay suite (the newest, on the committed page).
    """
    bench_result = json.loads(path.read_text())
    env, result = bench_result["environment"], bench_result["result"]
    capacity = relay_capacity(result)
    rows = "".join(f"| `{r['preset']}` | {r.get('mode', 'diloco')} | {r['parameters']:,} | {r['trainers']} |"
                   f" {r['bytes_per_round'] / r['trainers'] / 1e6:.1f} | {r['seconds_median']:.2f} |"
                   f" {r['cpu_seconds_median'] / r['trainers']:.2f} |\n" for r in result["results"])
    if capacity.cpu_per_trainer_s is None:
        served = (f"about {capacity.trainers_per_gigabit:.0f} per Gbit/s of its link, each way (one model size"
                  " measured: no CPU cost per parameter to carry over)")
    else:
        served = (f"about {min(capacity.trainers_per_core, capacity.trainers_per_gigabit):.0f}: one core of its CPU"
                  f" keeps up with {capacity.trainers_per_core:.0f} ({capacity.cpu_per_trainer_s:.1f} s per trainer and"
                  f" round: {capacity.fixed_cpu_s:.2f} s plus {capacity.per_parameter_cpu_s * 1e6:.3f} s per million"
                  " parameters, fitted on the two-trainer diloco runs of two model sizes), and a link of"
                  f" {GIGABIT_BYTES_S * 8 / 1e9:.0f} Gbit/s each way with {capacity.trainers_per_gigabit:.0f}")
    return (
        "## The coordinator as a relay for unreachable peers\n\n"
        f"From the relay suite's result `{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}`"
        f" (`{bench_result['command']}` on"
        f" {env['date']}, commit {env['commit']}): each trainer behind a NAT of its own, so that the coordinator leads"
        " every round as an auxiliary peer and every trainer's copy goes through it, in and back. Per trainer and"
        " round, medians over the rounds relayed with every trainer:\n\n"
        "| preset | mode | parameters | trainers | through the coordinator (MB) | a round (s) | relay CPU (s) |\n"
        "|---|---|---:|---:|---:|---:|---:|\n" + rows + "\n"
        f"**Extrapolated, not measured:** for `{capacity.mission}` ({capacity.mission_parameters:,} parameters, fp16"
        f" on the wire) each unreachable trainer moves {capacity.bytes_per_trainer / 1e6:.0f} MB through the"
        f" coordinator per round. At a round every {ROUND_EVERY_S:.0f} s, the largest swarm of unreachable trainers"
        f" one coordinator serves is {served}. Reachable"
        " volunteers cost it nothing: one of them leads the rounds, and the coordinator relays only when none can be"
        " dialled. What lifts it: a reachable volunteer in the swarm, or a coordinator with more cores and a faster"
        " link.\n\n")


def scale_page(result: dict, env: dict, out: Path) -> str:
    """The whole of logbook/scale.md from a bench result's `result`: benchmarks.bench's renderer for the scale suite.

    Args:
        result: the bench result's `result` (benchmarks.scale.scale_suite's).
        env: the bench result's environment, with the command that measured it and the result's path.
        out: the folder for the page's plots (it has none).
    """
    # a publisher run that failed has no figures to fit: the publishers' section names it
    publishers = [p for p in result["publishers"] if "error" not in p]
    fits = fit_costs(result["costs"], publishers)
    spread = storm_spread(result["storm"]["served"])
    limits = scale_limits(fits, spread, result["models"])
    return (header_section(env) + swarms_section(result) + publishers_section(result["publishers"])
            + storm_section(result["storm"], spread) + fits_section(fits)
            + extrapolation_section(result["models"], fits, spread, limits) + limits_section(limits)
            + "\n" + relay_cost_section(newest_result("relay")))
