"""Robust aggregation (hivetrain.robust) as a function of the peers' copies of a part, and inside real hivemind
all-reduce rounds (hivetrain.hivemind_internals): four averagers over loopback, one of them malicious."""

import concurrent.futures
import itertools

import pytest
import torch
from hivemind.averaging import DecentralizedAverager

from hivetrain.hivemind_internals import robust_averager_class
from hivetrain.robust import RobustAggregation, centered_clip, sort_copies, trimmed_mean, trusted_copies
from hivetrain.swarm import DHTOptions, start_dht

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
AGGREGATIONS = ("none", "centered-clip", "trimmed-mean")
SIZE = 20_000  # floats per peer: several parts each of the 4 reducers combines (part_size_bytes below)


def _honest_copies(count: int, size: int, seed: int) -> torch.Tensor:
    """What honest peers send: a shared signal plus each peer's own noise, as gradients of different batches."""
    generator = torch.Generator().manual_seed(seed)
    signal = torch.randn(size, generator=generator)
    return signal + 0.5 * torch.randn(count, size, generator=generator)


def _spread(copies: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The honest peers' weighted mean, and their mean distance from it (the yardstick for 'close')."""
    mean = (weights[:, None] * copies).sum(0) / weights.sum()
    return mean, (copies - mean).norm(dim=1).mean().item()


# --- the functions -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("attack", [1000.0, -10.0])
@pytest.mark.parametrize("kind", ["centered-clip", "trimmed-mean"])
def test_one_scaled_copy_in_four_barely_moves_the_robust_aggregate(kind, attack):
    honest = _honest_copies(3, 5000, seed=1)
    weights = torch.ones(3)
    honest_mean, spread = _spread(honest, weights)
    attacked = torch.cat([honest, attack * honest[:1]])
    aggregate = RobustAggregation(kind)(list(attacked), [1.0] * 4, torch.Size([5000]))
    plain_mean = attacked.mean(0)
    assert (plain_mean - honest_mean).norm() > 5 * spread  # what the attack does to hivemind's mean
    assert (aggregate - honest_mean).norm() < 0.6 * spread


def test_centered_clip_of_copies_within_the_radius_is_their_weighted_mean():
    copies = _honest_copies(4, 1000, seed=2)
    weights = torch.tensor([1.0, 2.0, 2.0, 1.0])
    assert torch.allclose(centered_clip(copies, weights, clip_radius=100.0, iterations=3),
                          (weights[:, None] * copies).sum(0) / weights.sum(), atol=1e-5)


def test_trimmed_mean_drops_each_coordinates_extremes_and_weighs_the_rest():
    copies = torch.tensor([[0.0, 10.0], [1.0, 1.0], [3.0, 2.0], [100.0, -50.0]])
    weights = torch.tensor([1.0, 1.0, 3.0, 1.0])
    # coordinate 0 keeps 1 (w 1) and 3 (w 3); coordinate 1 keeps 1 (w 1) and 2 (w 3)
    assert torch.allclose(trimmed_mean(copies, weights, 0.25), torch.tensor([2.5, 1.75]))
    assert torch.equal(trimmed_mean(copies[:2], weights[:2], 0.25), torch.tensor([0.5, 5.5]))  # 2 copies: no trim


def test_claimed_weights_count_up_to_the_groups_median_and_bad_ones_leave_their_copy_out():
    shape = torch.Size([3])
    ones = torch.ones(3)
    parts = [ones, 2 * ones, 3 * ones, 4 * ones, torch.full((3,), float("nan")), torch.ones(4), 5 * ones, 6 * ones]
    weights = [1.0, 2.0, 3.0, 1e9, 1.0, 1.0, 0.0, float("nan")]
    rows, kept = trusted_copies(parts, weights, shape)
    # the NaN copy, the 4-float copy, the zero weight and the NaN weight are out; 1e9 counts as the median, 2
    assert torch.equal(rows[:, 0], torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert torch.equal(kept, torch.tensor([1.0, 2.0, 2.0, 2.0]))
    assert trusted_copies([None, torch.full((3,), float("inf"))], [1.0, 1.0], shape) == (None, None)
    assert torch.isnan(RobustAggregation("centered-clip")([None], [1.0], shape)).all()


# --- inside hivemind's all-reduce --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def four_dhts():
    first = start_dht(DHTOptions(host_maddrs=LOOPBACK))
    dhts = [first] + [start_dht(DHTOptions(initial_peers=[str(a) for a in first.get_visible_maddrs()],
                                           host_maddrs=LOOPBACK)) for _ in range(3)]
    yield dhts
    for dht in reversed(dhts):
        dht.shutdown()


_prefixes = itertools.count()


def _all_reduce(dhts, kind: str, copies: torch.Tensor, weights: list[float]) -> list[torch.Tensor]:
    """One all-reduce round of real averagers, one per DHT, each holding its row of `copies`; what each ends with."""
    aggregation = RobustAggregation(kind) if kind != "none" else None
    averager_class = robust_averager_class(DecentralizedAverager)
    prefix = f"robust_test_{kind}_{next(_prefixes)}"
    averagers = [averager_class([copy.clone()], dht, prefix=prefix, aggregation=aggregation, start=True,
                                target_group_size=len(dhts), min_group_size=len(dhts), min_matchmaking_time=1.0,
                                request_timeout=1.0, part_size_bytes=4 * SIZE // 8, allreduce_timeout=30.0)
                 for dht, copy in zip(dhts, copies)]
    try:
        with concurrent.futures.ThreadPoolExecutor(len(averagers)) as pool:
            rounds = [pool.submit(averager.step, weight=weight, timeout=30.0)
                      for averager, weight in zip(averagers, weights)]
            groups = [round_.result() for round_ in rounds]
        assert all(group is not None and len(group) == len(dhts) for group in groups), "the four did not average"
        results = []
        for averager in averagers:
            with averager.get_tensors() as [tensor]:
                results.append(tensor.clone())
        return results
    finally:
        for averager in averagers:
            averager.shutdown()


@pytest.mark.parametrize("kind", AGGREGATIONS)
def test_a_malicious_averager_in_four(four_dhts, kind):
    """Three honest averagers and one that sends its copy x1000 with a claimed weight of 1e6: hivemind's mean is
    ruined; with a robust aggregation the honest peers end close to their own sample-weighted mean. Each reducer
    combines its parts alone, yet every peer ends with the same vector."""
    honest = _honest_copies(3, SIZE, seed=3)
    honest_weights = [1.0, 2.0, 3.0]
    honest_mean, spread = _spread(honest, torch.tensor(honest_weights))
    copies = torch.cat([honest, 1000.0 * honest[:1]])
    results = _all_reduce(four_dhts, kind, copies, honest_weights + [1e6])
    for result in results[1:]:
        assert torch.allclose(result, results[0], atol=1e-4 * results[0].abs().max().item())
    error = (results[0] - honest_mean).norm().item()
    # CenteredClip lands within a fraction of the honest spread; the trimmed mean keeps, per coordinate, the middle
    # two of four values, so it lies about as far from the honest mean as the nearest honest copies do.
    bound = {"none": None, "centered-clip": 0.6 * spread, "trimmed-mean": 0.8 * spread}[kind]
    if bound is None:
        assert error > 100 * spread
    else:
        assert error < bound, f"{kind}: {error:.1f} from the honest mean, whose copies lie {spread:.1f} away"


def test_robust_aggregation_of_honest_averagers_stays_near_their_weighted_mean(four_dhts):
    """Without an attacker, centered-clip keeps the honest peers' weighted mean up to a small share of their spread:
    robust aggregation costs the honest swarm little."""
    honest = _honest_copies(4, SIZE, seed=4)
    weights = [1.0, 1.0, 2.0, 2.0]
    honest_mean, spread = _spread(honest, torch.tensor([1.0, 1.0, 1.0, 1.0]))  # 2 is the median: all count 1
    [result, *_] = _all_reduce(four_dhts, "centered-clip", honest, weights)
    assert (result - honest_mean).norm().item() < 0.2 * spread


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7, 16, 17])
def test_sorting_the_copies_matches_torch_sort_and_moves_the_weights_along(count):
    generator = torch.Generator().manual_seed(count)
    copies = torch.randint(0, 5, (count, 300), generator=generator).float()  # many ties
    weights = torch.rand(count, generator=generator) + 0.5
    values, value_weights = sort_copies(copies, weights)
    assert torch.equal(values, copies.sort(dim=0).values)
    assert torch.equal(sort_copies(copies)[0], values)
    # each coordinate's (value, weight) pairs are the same multiset as before sorting
    for column in range(0, 300, 37):
        before = sorted(zip(copies[:, column].tolist(), weights.tolist()))
        assert sorted(zip(values[:, column].tolist(), value_weights[:, column].tolist())) == before


def test_a_robust_diloco_round_groups_only_peers_of_the_same_round(four_dhts):
    """Three outer states at round 5 and one still at round 4: the three average together, the one behind finds no
    group (its honest but stale copy would have widened the spread an attacker's copy may move the result by)."""
    from hivetrain.outer_state import OuterState

    prefix = f"robust_rounds_{next(_prefixes)}"
    states = [OuterState([torch.full((1000,), float(i))], dht, prefix, outer_lr=1.0, outer_momentum=0.0,
                         aggregation=RobustAggregation("centered-clip"), min_matchmaking_time=2.0,
                         request_timeout=1.0, allreduce_timeout=30.0) for i, dht in enumerate(four_dhts)]
    try:
        for state, round_ in zip(states, (5, 5, 5, 4)):
            state.round = round_
        with concurrent.futures.ThreadPoolExecutor(len(states)) as pool:
            rounds = [pool.submit(state.outer_step, [torch.full((1000,), float(i))], 1.0, 15.0)
                      for i, state in enumerate(states)]
            results = [round_.result() for round_ in rounds]
        assert results == [True, True, True, None]
        assert [state.last_group_size for state in states] == [3, 3, 3, 1]
        assert [state.round for state in states] == [6, 6, 6, 5]
    finally:
        for state in states:
            state.shutdown()
