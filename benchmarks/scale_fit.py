"""The scale suite's fit and extrapolation (issue 21): straight lines through what benchmarks.scale measured, the
costs they give at 100, 1,000 and 10,000 peers, how a joiner storm's downloads spread over the state holders, and
where each cost becomes a limit. benchmarks.scale_page writes them into logbook/scale.md. Tools that no role imports:
this stays in benchmarks/.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

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


# The fit -------------------------------------------------------------------------------------------------------------

def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = a + b x; (a, b).

    Args:
        points: the measured (x, y) pairs; with fewer than two distinct x, the line is flat at the first y.
    """
    xs, ys = [x for x, _ in points], [y for _, y in points]
    if len(set(xs)) < 2:
        return ys[0], 0.0
    slope, intercept = statistics.linear_regression(xs, ys)
    return intercept, slope


def growing(points: list[tuple[float, float]]) -> tuple[float, float, bool]:
    """fit(points), unless the cost fell as N grew (the shared machine gave each process less, not a trend to
    extrapolate): then the value at the smallest N, held constant. (a, b, whether it fell).

    Args:
        points: a cost's measured (N, value) pairs; none gives a line at NaN.
    """
    if not points:
        return float("nan"), 0.0, False
    a, b = fit(points)
    if b < 0:
        return min(points)[1], 0.0, True
    return a, b, False


def crossing(a: float, b: float, limit: float) -> float | None:
    """The x at which a + b x reaches `limit` (None: never, it does not grow).

    Args:
        a: the line's value at x = 0.
        b: its slope.
        limit: the value it must not reach.
    """
    if a >= limit:
        return 0.0
    return (limit - a) / b if b > 0 else None


@dataclass(frozen=True)
class CostFits:
    """The straight lines through the measured costs, by cost: coordinator_cores, look_s, rss_mib, background_cores
    and round_s (against the group size)."""

    points: dict[str, list[tuple[float, float]]]  # each cost's measured (N, value) pairs
    lines: dict[str, tuple[float, float, bool]]  # growing(points): (a, b, whether the cost fell as N grew)
    # a peer's background cores per peer: modelled, since the shared machine gave the peers less as they multiplied
    background_model_slope: float
    fell_apart: list[dict]  # the swarms whose groups fell short of what they asked: their rounds are left out


def fit_costs(costs: list[dict], publishers: list[dict]) -> CostFits:
    """Fit each cost the page extrapolates, from the runs that measure it best.

    Args:
        costs: the bench result's swarms of training peers.
        publishers: its runs of lightweight publishers that did not fail.
    """
    whole = [c for c in costs if c["target_group_size"] is None]  # groups as large as the swarm
    # The coordinator's CPU from the publishers where measured: its look then costs what N peers' records cost (the
    # training swarms' coordinators shared two saturated cores with the peers, and looked five times less often).
    coordinator_points = [(p["publishers"], p["coordinator_cpu_percent"] / 100) for p in publishers] or [
        (c["peers"], c["coordinator_cores"]) for c in whole]
    # The look's time likewise: in the training swarms it waited for saturated cores.
    look_points = [(p["publishers"], p["look_median_s"]) for p in publishers] or [
        (c["peers"], c["look_median_s"]) for c in whole if c["look_median_s"] is not None]
    rss_points = [(c["peers"], c["coordinator_rss_bytes"] / 2**20) for c in whole] + [
        (p["publishers"], p["coordinator_rss_bytes"] / 2**20) for p in publishers]
    background_points = [(c["peers"], c["peer_background_cores"]) for c in whole]
    # A round against its group only where the group formed as asked: a swarm whose rounds fell apart (groups
    # smaller than asked for) measures the saturated machine, not the group size.
    formed = [c for c in costs if c["round_seconds"] is not None and c["group_size_median"] is not None
              and c["group_size_median"] >= (c["target_group_size"] or c["peers"])]
    fell_apart = [c for c in costs if c not in formed and c["round_seconds"] is not None]
    round_points = [(c["group_size_median"], c["round_seconds"]) for c in formed]
    points = dict(coordinator_cores=coordinator_points, look_s=look_points, rss_mib=rss_points,
                  background_cores=background_points, round_s=round_points)
    lines = {name: growing(cost_points) for name, cost_points in points.items()}
    # A peer's background work as N grows, modelled: its progress tracker reads all N progress records about every
    # PROGRESS_READ_EVERY_S, at the coordinator's measured cost per record read (its look every 2 s reads each
    # peer's records): the measured fit alone cannot show it, the machine gave the peers less as they multiplied.
    background_model_slope = lines["coordinator_cores"][1] * PUBLISHERS_LOOK_EVERY_S / PROGRESS_READ_EVERY_S
    return CostFits(points, lines, background_model_slope, fell_apart)


# The extrapolation ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StormSpread:
    """How the joiner storm's downloads spread over the state holders."""

    served: dict[str, int]  # downloads each holder answered during the storm
    downloads: int  # all of them
    busiest: str  # the holder that answered the most
    busiest_share: float  # its share of the downloads (1 where there were none)
    holders: int  # the holders that answered any


def storm_spread(served: dict[str, int]) -> StormSpread:
    """The spread of a storm's downloads.

    Args:
        served: the downloads each holder answered during the storm (the bench result's storm["served"]).
    """
    downloads = sum(served.values())
    busiest = max(served, key=served.get)
    busiest_share = served[busiest] / downloads if downloads else 1.0
    return StormSpread(served, downloads, busiest, busiest_share, sum(1 for count in served.values() if count > 0))


@dataclass(frozen=True)
class Limit:
    """Where a cost stops a swarm growing."""

    at: float | None  # the N from which it is reached (None: never, the cost does not grow)
    condition: str  # when it is reached, in words
    lift: str  # what lifts it


def mission_model(models: dict) -> tuple[str, dict]:
    """The preset a real run uses (the one that is not the demo's), and its model's sizes.

    Args:
        models: the bench result's state_sizes(), by preset.
    """
    name = next(k for k in models if k != "demo")
    return name, models[name]


def storm_seconds(size: int, share: float, state_bytes: float) -> float:
    """Seconds a holder's uplink needs to send its share of a storm of JOIN_FRACTION x `size` joiners.

    Args:
        size: the swarm's peers.
        share: the share of the storm's downloads the holder answers.
        state_bytes: the bytes of one state download.
    """
    return JOIN_FRACTION * size * share * state_bytes / UPLINK_BYTES_S


def scale_limits(fits: CostFits, spread: StormSpread, models: dict) -> dict[str, Limit]:
    """Each limit the page names, by what limits, in the order the page lists them.

    Args:
        fits: the fitted costs.
        spread: how the storm's downloads spread.
        models: the bench result's state_sizes(), by preset.
    """
    lines, demo, (_, mission) = fits.lines, models["demo"], mission_model(models)
    # the busiest holder's share of a storm of JOIN_FRACTION x N joiners, on its uplink with the mission's state
    storm_per_peer_s = JOIN_FRACTION * spread.busiest_share * mission["state_bytes"] / UPLINK_BYTES_S
    return {
        "the coordinator's look (one look slower than the refresh)": Limit(
            crossing(*lines["look_s"][:2], REFRESH_S), f"a look takes {REFRESH_S:.0f} s (`--refresh`)",
            "a longer `--refresh`; beyond that, a look that reads only records changed since the last (a design"
            " change: hivemind's DHT returns every subkey of the metrics and progress keys each time)"),
        "the coordinator's CPU": Limit(
            crossing(*lines["coordinator_cores"][:2], COORDINATOR_CORES), f"{COORDINATOR_CORES:.0f} core",
            "the same as the look: fewer, incremental reads; the validation runs on a machine of its own"),
        "each peer's background work (the DHT refreshes, and its rounds' networking)": Limit(
            crossing(lines["background_cores"][0], fits.background_model_slope, VOLUNTEER_BACKGROUND_CORES),
            f"{VOLUNTEER_BACKGROUND_CORES} core of background work per peer",
            "longer refresh periods (the progress tracker's and `PUBLISH_EVERY`), and each peer reading a bounded"
            " sample of the progress records rather than all N (a design change in the round trigger)"),
        "all-reduce fan-in (one group of the whole swarm)": Limit(
            crossing(*lines["round_s"][:2], demo["averaging_timeout_s"]),
            f"a round takes the demo preset's averaging timeout, {demo['averaging_timeout_s']:.0f} s",
            "`--target-group-size` (groups of G, drawn anew each round): the round then costs what a group of G"
            " costs, at any N"),
        "a joiner storm on the state holders": Limit(
            STORM_WAIT_S / storm_per_peer_s,
            f"the busiest holder needs over {STORM_WAIT_S / 60:.0f} minutes to send its share",
            "more holders: every reachable peer serves at the same priority (hivemind draws at random among the"
            " newest), so the share per holder is 1 / holders; the coordinator with a faster uplink"),
    }


def first_limits(limits: dict[str, Limit], size: int) -> str:
    """The limits a swarm of `size` peers has reached, the earliest first, in words.

    Args:
        limits: scale_limits().
        size: the swarm's peers.
    """
    hit = sorted((limit.at, what) for what, limit in limits.items() if limit.at is not None and limit.at <= size)
    return "none of those modelled" if not hit else "; ".join(f"{what} (from about {at:,.0f} peers)"
                                                              for at, what in hit)
