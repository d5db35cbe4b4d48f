"""Robust aggregation of the peers' copies of one all-reduce part: what a part's reducer computes in place of
hivemind's weighted mean when the run's swarm.robust_aggregation says so.

In hivemind's butterfly all-reduce every peer reduces one slice ("part") of the averaged vector and sees every
peer's copy of that slice, never the whole of anyone's vector. A weighted mean there lets one peer move the result
anywhere: its copy scaled by 1000, or a weight of 1e9. BTARD (Gorbunov et al. 2021, "Secure Distributed Training at
Scale") replaces that mean with CenteredClip on each part; a coordinate-wise trimmed mean is the simpler
alternative. Both are here, as plain functions of the copies and their weights; hivetrain.hivemind_internals puts
them inside hivemind's reducer.

Everything a part's reducer receives from another peer is untrusted: its values, its shape and the weight it claims.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from hivetrain.config import SwarmConfig

# CenteredClip's iterations. From the coordinate-wise median, a few suffice: each moves the estimate by at most the
# clipping radius, and the median is already within about a radius of the honest peers' centre.
CENTERED_CLIP_ITERATIONS = 10


@dataclass(frozen=True)
class RobustAggregation:
    """One way to combine the peers' copies of a part: "centered-clip" or "trimmed-mean" (see the functions below)."""

    kind: str
    clip_radius: float = SwarmConfig.clip_radius
    trim_fraction: float = SwarmConfig.trim_fraction

    def __post_init__(self) -> None:
        if self.kind not in ("centered-clip", "trimmed-mean"):
            raise ValueError(f"robust aggregation {self.kind!r} is not centered-clip or trimmed-mean")

    @classmethod
    def for_swarm(cls, swarm: Any) -> Optional[RobustAggregation]:
        """The aggregation a run's SwarmConfig (or HivemindOptions) asks for; None for hivemind's own mean."""
        kind = getattr(swarm, "robust_aggregation", "none")
        if kind == "none":
            return None
        return cls(kind, clip_radius=swarm.clip_radius, trim_fraction=swarm.trim_fraction)

    def __call__(self, parts: Sequence[Optional[torch.Tensor]], weights: Sequence[float],
                 shape: torch.Size) -> torch.Tensor:
        """The aggregate of the copies of one part of `shape`. A copy given as None (one of the wrong shape, say)
        counts as absent."""
        usable, usable_weights = trusted_copies(parts, weights, shape)
        if usable is None:  # no peer sent finite values: as hivemind's mean would, the result is not finite
            return torch.full(shape, float("nan"))
        if self.kind == "centered-clip":
            aggregate = centered_clip(usable, usable_weights, self.clip_radius)
        else:
            aggregate = trimmed_mean(usable, usable_weights, self.trim_fraction)
        return aggregate.reshape(shape)


def trusted_copies(parts: Sequence[Optional[torch.Tensor]], weights: Sequence[float],
                   shape: torch.Size) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The copies worth combining, stacked as rows (float32), and their weights; (None, None) if there is none.

    - A copy of the wrong shape or with a non-finite value is left out: an honest peer never sends one (its NaN guard
      skips such a step), and a single NaN would spread to every coordinate CenteredClip touches.
    - A weight that is not finite or not positive leaves its copy out, as hivemind's mean gives such a peer nothing
      (a zero weight) or nonsense (a negative or NaN one).
    - A weight counts up to the group's median weight. Weights are what each peer claims (its samples since the last
      round), so one peer could otherwise claim 1e9 and be the whole aggregate whatever clipping or trimming does.
      The price: among honest peers, one that trained more samples than the group's median counts as the median.
    """
    rows, kept_weights = [], []
    for part, weight in zip(parts, weights):
        if part is None or part.shape != shape or not math.isfinite(weight) or weight <= 0:
            continue
        rows.append(part.reshape(-1).to(torch.float32))
        kept_weights.append(weight)
    if not rows:
        return None, None
    stacked = torch.stack(rows)
    finite = torch.isfinite(stacked).all(dim=1)  # one pass over all copies
    if not finite.any():
        return None, None
    weight_column = torch.tensor(kept_weights, dtype=torch.float64)[finite]
    weight_column = weight_column.clamp(max=weight_column.median().item()).to(torch.float32)  # the lower median
    return (stacked if finite.all() else stacked[finite]), weight_column


# Up to this many copies, sorting each coordinate runs as an odd-even transposition network of elementwise minima and
# maxima over whole rows: for the few copies of an averaging group that is several times faster than torch.sort
# along dim 0, which sorts each coordinate's handful of values separately.
SORTING_NETWORK_MAX_COPIES = 16


def sort_copies(copies: torch.Tensor, weights: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Each coordinate's values across the copies (rows) in ascending order; with `weights` (one per copy), each
    value's weight moved along with it (a tensor of the copies' shape)."""
    count = copies.shape[0]
    if count > SORTING_NETWORK_MAX_COPIES:
        values, order = copies.sort(dim=0)
        return values, (None if weights is None else weights[order])
    rows = list(copies.unbind(0))
    row_weights = None if weights is None else [w.expand_as(rows[0]) for w in weights]
    for sweep in range(count):
        for low in range(sweep % 2, count - 1, 2):
            a, b = rows[low], rows[low + 1]
            if row_weights is not None:
                swap = a > b
                wa, wb = row_weights[low], row_weights[low + 1]
                row_weights[low], row_weights[low + 1] = torch.where(swap, wb, wa), torch.where(swap, wa, wb)
            rows[low], rows[low + 1] = torch.minimum(a, b), torch.maximum(a, b)
    return torch.stack(rows), (None if row_weights is None else torch.stack(row_weights))


def _middle(sorted_rows: torch.Tensor) -> torch.Tensor:
    """The median of rows already sorted along dim 0: the mean of the two middle rows for an even count."""
    count = sorted_rows.shape[0]
    return (sorted_rows[(count - 1) // 2] + sorted_rows[count // 2]) / 2


def centered_clip(copies: torch.Tensor, weights: torch.Tensor, clip_radius: float,
                  iterations: int = CENTERED_CLIP_ITERATIONS) -> torch.Tensor:
    """CenteredClip (Karimireddy et al. 2021, as BTARD applies it per part): starting from the coordinate-wise median
    v, repeat v <- v + sum_i w_i clip(x_i - v, tau) / sum_i w_i, where clip scales a vector down to norm tau.

    tau = clip_radius x the median distance of the copies from the coordinate-wise median, so that the radius is a
    multiple of how far honest peers' copies usually lie apart, whatever the scale of the part (a gradient, a
    parameter slice), rather than a number to tune per model. A copy within tau of v counts in full, as in a mean; one
    further away pulls with a force of at most tau, so a minority of peers moves the result by at most about their
    share of the weight times tau, however large what they sent."""
    start = _middle(sort_copies(copies)[0])
    radius = clip_radius * _middle((copies - start).norm(dim=1).sort().values)
    estimate = start
    total_weight = weights.sum()
    for iteration in range(iterations):
        offsets = copies - estimate
        distances = offsets.norm(dim=1)
        scales = torch.where(distances > radius, radius / distances.clamp(min=torch.finfo(torch.float32).tiny),
                             torch.ones_like(distances))
        step = ((weights * scales) @ offsets) / total_weight
        estimate = estimate + step
        if step.norm() <= 1e-6 * radius:  # settled: further iterations would move it by float rounding only
            break
    return estimate


def trimmed_mean(copies: torch.Tensor, weights: torch.Tensor, trim_fraction: float) -> torch.Tensor:
    """Per coordinate, the weighted mean of the copies' values after dropping the `trimmed` lowest and highest,
    trimmed = floor(trim_fraction x copies), at least one each side from 3 copies on, and always leaving one: a peer
    whose values are extreme is dropped wherever they are extreme, whatever weight it claims."""
    count = copies.shape[0]
    trimmed = min(max(1, math.floor(trim_fraction * count)), (count - 1) // 2)
    if bool((weights == weights[0]).all()):  # equal weights (the usual case once capped): a plain mean of the rest
        return sort_copies(copies)[0][trimmed:count - trimmed].mean(dim=0)
    values, value_weights = sort_copies(copies, weights)
    kept_values, kept_weights = values[trimmed:count - trimmed], value_weights[trimmed:count - trimmed]
    return (kept_values * kept_weights).sum(dim=0) / kept_weights.sum(dim=0)
