"""When DiLoCo rounds fall due, and what a round trains: the progress tracker whose target is H inner steps per peer,
and the clock's grid of rounds paced in seconds that peers and the coordinator share (its monitor, its relay).

When a round starts: once the samples the swarm trained since the last round reach H x (the run's per-step batch) x
(peers in the progress records), i.e. once the peers have taken H local steps each on average. Nobody waits for a
slow peer's H-th step: a fast peer takes more inner steps, a slow one fewer, and each pseudo-gradient counts in
proportion to its samples. A peer counts its own samples at once and the others' by their records, each carried
forward at the rate it states (RoundTracker.others_samples): a round of fast peers can be shorter than the half second
a record takes to reach the others. A peer starts looking for the round's group a matchmaking time before the swarm's
samples are estimated to reach the target (hivemind's tracker: the peers' records and rates), as hivemind's Optimizer
schedules its gradient rounds, and a blocking round's all-reduce starts with the group already formed.

Rounds paced in seconds (`round_seconds` S, the coordinator's --round-seconds): a round falls due at every S seconds of
the wall clock (next_round_time), the same grid on every peer, and each peer takes as many inner steps as its device
fits in between: a GPU peer and a CPU peer share one schedule, each pseudo-gradient weighted by its samples. The grid
being known ahead, a peer starts looking for its group 1.5 matchmaking times before the round is due (hivemind's
scheduled step, OuterState.schedule_round; group_time), and the round's all-reduce starts with the group already
formed.
"""

from __future__ import annotations

import math
from typing import Optional

from hivemind.optim.progress_tracker import LocalTrainingProgress

from hivetrain.config import SwarmConfig
from hivetrain.hivemind_internals import HookedProgressTracker, progress_subkey
from hivetrain.record_guard import INT64_MAX, parse_entry
from hivetrain.telemetry import bounded_sum


# Seconds a progress record vouches for its peer's training at the rate it states: a training peer's record is stored
# every 0.5 s at most (hivemind_internals.PROGRESS_STORE_EVERY) and read every 0.5 s at best, so a live one is rarely
# older; one older than this is a peer that stopped (RoundTracker.others_samples).
RECORD_CARRY = 2.0


def next_round_time(after: float, round_seconds: float) -> float:
    """When the next round paced in seconds falls due: the first multiple of `round_seconds` since the Unix epoch
    after `after` (a Unix time). Every peer derives the same grid from its own clock, with nobody's word to trust and
    nothing to agree on, so a joiner falls into the swarm's schedule at once. Peers' clocks must agree to well within
    the matchmaking time, as hivemind's matchmaking itself assumes (NTP keeps them within milliseconds)."""
    return (math.floor(after / round_seconds) + 1) * round_seconds


def paced_round_samples(samples_per_second: float, round_seconds: float) -> int:
    """What a swarm training `samples_per_second` trains in a round paced every `round_seconds`: what the coordinator
    shows as the round's target, and peers count a swarm epoch's samples by. Bounded to a storable integer, whatever
    the rates that peers' records state."""
    return int(min(samples_per_second * round_seconds, INT64_MAX))


def group_time(round_time: float, matchmaking_time: float) -> float:
    """When the group of a round paced in seconds forms: half a matchmaking time before the round falls due, so that
    the group stands ready (waiting for each peer's trigger) when it does. Its search starts a matchmaking time
    earlier still (hivemind's matchmaking lasts at least that long). Peers and the coordinator's relay all aim at this
    time: hivemind's leader turns away a follower whose search ends later than its own."""
    return round_time - matchmaking_time / 2


def rounds_description(swarm: SwarmConfig) -> str:
    """How a diloco run's rounds are paced and run, in words (the coordinator's and each peer's console)."""
    paced = (f"every {swarm.round_seconds:g} s of the clock, each peer taking the inner steps its device fits, its"
             f" group looked for ahead" if swarm.round_seconds else f"every {swarm.inner_steps} inner steps per peer")
    run = "overlapped with the next inner steps" if swarm.overlap_rounds else "blocking (training stops for each round)"
    return f"{paced}; {run}"


class RoundTracker(HookedProgressTracker):
    """hivemind's progress tracker whose target is H inner steps of the run's batch per peer in the records: a round
    is due once the swarm as a whole has trained that many samples since the last one."""

    def __init__(self, *args, samples_per_peer: int, round_seconds: Optional[float] = None, **kwargs):
        self.samples_per_peer, self.round_seconds = samples_per_peer, round_seconds
        self.others: list[tuple[int, float, float, float]] = []  # (round, samples, samples/s, time): others_samples
        super().__init__(*args, target_batch_size=samples_per_peer, **kwargs)

    def before_parsing_progress(self, metadata):
        values = [entry.value for entry in metadata.values() if getattr(entry, "value", None) is not None] \
            if isinstance(metadata, dict) else []
        self.others = _others_progress(metadata, progress_subkey(self))
        self.target_batch_size = self.samples_per_peer * max(1, len(values))
        if self.round_seconds is not None and (rates := _training_rates(values)):
            # Rounds paced in seconds fall due by the clock (DiLoCoRounds.round_due); the target only says what the
            # swarm trains in a round, for the epoch's samples/s and hivemind's estimate of the next round's arrival
            self.target_batch_size = max(1, paced_round_samples(bounded_sum(rates), self.round_seconds))
        return super().before_parsing_progress(metadata)

    def others_samples(self, round_: int, round_began: float, now: float) -> float:
        """The samples the other peers have trained toward `round_` by `now` (DHT time), as hivemind's estimate of the
        next epoch carries each record forward at the rate it states, for RECORD_CARRY seconds after the time it
        states at most (a peer that stopped, in a round or waiting for one, reports no more). A record of the round
        before (the peer's first record of this one not read yet) counts from `round_began` on, when this peer's
        own steps toward the round began. No record counts for more than the round's whole target."""
        total = 0.0
        for record_round, samples, rate, at in self.others:
            until = min(now, at + RECORD_CARRY)
            if record_round == round_:
                estimate = samples + rate * max(0.0, until - at)
            elif record_round == round_ - 1:
                estimate = rate * max(0.0, until - max(at, round_began))
            else:
                continue
            total += min(estimate, self.target_batch_size)
        return total

    def update_epoch(self, new_epoch: Optional[int] = None) -> int:
        """A new round: read the others' records for it soon (fetch_soon), not at a read planned before it began."""
        epoch = super().update_epoch(new_epoch)
        self.fetch_soon()
        return epoch


def _others_progress(metadata, own_subkey: bytes) -> list[tuple[int, float, float, float]]:
    """(round, samples, samples/s, time) of every other peer's progress record that parses as the guard parses one
    (record_guard.parse_entry: hivemind's schema, whose counts and rate are not negative, and finite numbers) and
    states a time after the Unix epoch."""
    found = []
    for subkey, entry in (metadata.items() if isinstance(metadata, dict) else ()):
        value = getattr(entry, "value", None)
        if subkey == own_subkey or value is None:
            continue
        record, _ = parse_entry(LocalTrainingProgress, value)
        if record is not None and record.time >= 0:
            found.append((record.epoch, float(record.samples_accumulated), record.samples_per_second, record.time))
    return found


def _training_rates(values: list) -> list[float]:
    """The samples/s each progress record states (hivemind's compute-only rate), where it is a usable number."""
    rates = [value.get("samples_per_second") if isinstance(value, dict) else None for value in values]
    return [float(rate) for rate in rates
            if isinstance(rate, (int, float)) and not isinstance(rate, bool) and math.isfinite(rate) and rate > 0]
