"""DiLoCo rounds over hivemind: each peer trains H steps of its own optimizer, then the swarm takes one outer step
(SGD with Nesterov momentum) on the pseudo-gradient (outer parameters minus local parameters) averaged over the peers,
weighted by the samples behind each, and every peer goes on from the new outer parameters.

Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models": one all-reduce per H
local steps instead of one per step. Built on hivemind 1.1.12's own pieces, without a fork: a `DecentralizedAverager`
averages the outer parameters (see OuterState for why it is the same step) and serves the outer state (parameters,
momentum, round) to joiners, and a `ProgressTracker` publishes each peer's samples under the run's progress key
and tells when a round is due.

When rounds fall due is hivetrain.round_schedule's (counted in samples, or paced in seconds on the clock's grid);
this module is a peer's side of them.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Optional, Sequence, Union

import torch
from hivemind import DHT
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.compression import CompressionBase, NoCompression
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from hivetrain.hivemind_internals import LEFT_ALONE_CHECK_S
from hivetrain.outer_state import GivenUp, OuterState, outer_state_prefix, round_matchmaking
from hivetrain.overlapped_round import RoundInFlight
from hivetrain.robust import RobustAggregation
from hivetrain.record_guard import others_epochs, vetted
from hivetrain.round_schedule import RoundTracker, group_time, next_round_time
from hivetrain.speedups import FiniteSteps
from hivetrain.swarm import DHT_READ_TIMEOUT, RECORD_LIFETIME, withdraw_records

logger = logging.getLogger(__name__)

MIN_REFRESH_PERIOD = 0.5  # seconds between two reads of the progress records at least (hivemind's tracker default)
GROUPMATES_WAIT = 5.0  # seconds a leaving peer waits at most for the groupmates of its last round to finish it


class DiLoCoRounds:
    """A peer's side of DiLoCo: counts its inner steps' samples, and when a round is due, runs it and puts the new
    outer parameters into the model.

    Blocking rounds (`overlap=False`) stop the inner steps until the round has averaged. Overlapped rounds run in the
    background (RoundInFlight) while the peer takes the next round's inner steps; the peer waits for one only when
    its next round is due (H inner steps since it began, or the next time on the grid of rounds paced in seconds) and
    the round has not finished yet (`wait_seconds`).

    `swarm_seconds` adds up the wall time the inner steps stood still for the swarm: blocking rounds, state downloads,
    and for overlapped rounds their start, corrections and waits; `communication_seconds` the wall time of overlapped
    rounds in the background; `missed_rounds` counts the rounds this peer did not average with the swarm (it missed
    one, or its all-reduce failed)."""

    def __init__(self, dht: DHT, run_id: str, parameters: Sequence[torch.nn.Parameter], inner_steps: int,
                 batch_size: int, outer_lr: float, outer_momentum: float, matchmaking_time: float,
                 averaging_timeout: float, next_chunk_timeout: float, compression: CompressionBase = NoCompression(),
                 state_compression: CompressionBase = NoCompression(), load_state_timeout: float = 60.0,
                 private_key: Optional[RSAPrivateKey] = None, aggregation: Optional[RobustAggregation] = None,
                 target_group_size: Optional[int] = None, overlap: bool = False,
                 round_seconds: Optional[float] = None):
        self.parameters = list(parameters)
        self.inner_steps, self.overlap, self.round_seconds = inner_steps, overlap, round_seconds
        self.matchmaking_time = matchmaking_time
        self.averaging_timeout, self.load_state_timeout = averaging_timeout, load_state_timeout
        self.withdrawn = False  # this peer's records are withdrawn: it is leaving
        self.progress_withdrawn = False  # its progress record is (stop_training): its state offer may still be up
        self.outer = OuterState(
            self.parameters, dht, outer_state_prefix(run_id), outer_lr, outer_momentum, compression=compression,
            state_compression=state_compression, aggregation=aggregation,
            **round_matchmaking(matchmaking_time, averaging_timeout, next_chunk_timeout, target_group_size),
        )
        # Vetted: entries anyone wrote under the progress key are untrusted, and must not raise the round's target.
        # Read at least every half matchmaking time. hivemind plans each next read from the rates at the last one,
        # near zero before the first steps: up to 10 s on, past the first round, which each peer then saw due by its
        # own samples and records it could carry forward only so far (RECORD_CARRY). On a loaded machine three peers
        # saw it due up to 0.4 s apart, with no group looked for ahead (no rates yet), and one was left out of it;
        # reading this often, they saw it due within 0.03 s of each other (12 runs).
        self.tracker = vetted(RoundTracker)(dht, run_id, samples_per_peer=inner_steps * batch_size,
                                            round_seconds=round_seconds, metadata_expiration=RECORD_LIFETIME,
                                            max_refresh_period=max(MIN_REFRESH_PERIOD, matchmaking_time / 2),
                                            private_key=private_key, start=True)
        self.outer.give_up = self._give_up
        self.samples = 0  # trained since the last round (overlapped: since the round in flight began)
        self.round_began = get_dht_time()  # when those samples began (DHT time): see round_due
        self.samples_discarded = 0  # trained in inner steps no round took: before a reload, or a non-finite restart
        self.inner_steps_since_round = 0  # this peer's steps (all its devices together count as one per step)
        self.last_round_steps: Optional[int] = None  # the inner steps behind this peer's last round
        # Rounds paced in seconds: when this peer's next round falls due, and its group looked for ahead (its round)
        self.next_round_at = next_round_time(time.time(), round_seconds) if round_seconds else None
        self.scheduled: Optional[tuple[int, StepControl]] = None
        self.rounds_group_ready = 0  # rounds looked for ahead whose group stood ready when they fell due
        self.flight: Optional[RoundInFlight] = None  # the overlapped round in the background
        self.swarm_seconds = self.wait_seconds = self.communication_seconds = 0.0
        self.last_overlapped_steps: Optional[int] = None  # inner steps taken while the last overlapped round ran
        self.rounds_averaged = self.rounds_alone = self.rounds_failed = self.rounds_missed = 0
        # (round, digest, probe) of the outer parameters the last overlapped round ended with (hivetrain.digests)
        self.landed: Optional[tuple[int, str, list[float]]] = None
        self.finite_steps = FiniteSteps()  # the inner steps' verdicts, read without stalling the GPU
        self.restarts = 0  # times a non-finite step sent this peer back to the outer parameters
        # (round, monotonic time) of the first of the reads in a row that found no other peer's record (_give_up)
        self._alone_since: Optional[tuple[int, float]] = None

    @property
    def round(self) -> int:
        """The round this peer is in: an overlapped round counts once it has landed."""
        return self.flight.round if self.flight is not None else self.outer.round

    def _progress_round(self) -> int:
        """The round this peer's progress records name: its own, except while it catches up (OuterState.catching_up)
        and the swarm's records have not reached its round yet. Its state then came from a round in flight, and it
        names that round until the round lands: the round after it, named at once, would tell the peers that have
        yet to take that round that they missed it (each would drop its samples and reload)."""
        if self.outer.catching_up and self.tracker.global_epoch < self.outer.round:
            return self.outer.round - 1
        return self.outer.round

    @property
    def num_peers(self) -> int:
        return self.tracker.global_progress.num_peers

    def _give_up(self, round_: int, looking: bool) -> Optional[GivenUp]:
        """Whether this peer's round `round_` should end now, from one read of the swarm's progress records:
        LEFT_ALONE once the reads of this round have found no other peer's record for a second; LEFT_BEHIND
        while the round is `looking` for its group and most other peers' records state a later round. Most, not
        one: a single record (one that lies, or a peer that went on alone) must not cut every peer's search short.
        None (go on) when the records cannot be read."""
        epochs = others_epochs(self.tracker, DHT_READ_TIMEOUT)
        if epochs is None:
            return None
        if not epochs:
            # Alone once the reads have found no other record for LEFT_ALONE_CHECK_S: a round looks four times as
            # often while it searches (LOOKING_CHECK_S), and a single read that missed the others' records (a
            # suite under load) then ended a paced peer's round while it waited for the other to come (test_diloco).
            now = time.monotonic()
            if self._alone_since is None or self._alone_since[0] != round_:
                self._alone_since = (round_, now)
            return GivenUp.LEFT_ALONE if now - self._alone_since[1] >= LEFT_ALONE_CHECK_S else None
        self._alone_since = None
        if looking and 2 * sum(epoch > round_ for epoch in epochs) > len(epochs):
            return GivenUp.LEFT_BEHIND
        return None

    @property
    def missed_rounds(self) -> int:
        return self.rounds_missed + self.rounds_failed

    def load_state_from_peers(self) -> bool:
        """Take the swarm's newest outer state, and start the next inner steps from it: those since the last round
        never reach the swarm (samples_discarded)."""
        self.finish_round()
        self.samples_discarded += self.samples
        started = time.perf_counter()
        try:
            self.cancel_scheduled()  # its round's group: this peer's round may change now
            loaded = self.outer.load_from_peers(timeout=self.load_state_timeout)
            self.outer.copy_to(self.parameters)
            self._begin_inner_steps()
            with self.tracker.pause_updates():
                self.tracker.update_epoch(self._progress_round())
            self.outer.advertise_round()
            return loaded
        finally:
            self.swarm_seconds += time.perf_counter() - started

    def after_inner_step(self, samples: int, finite: Union[bool, torch.Tensor] = True) -> bool:
        """Count an inner step's samples and run a round when one is due; True when the parameters changed to a
        new outer state (a round, a correction of an overlapped one, or a reload). A non-finite step (`finite`: a
        bool, or a 0-d bool tensor read when the GPU gets there, FiniteSteps) restarts this peer's inner steps from the
        outer parameters, its samples uncounted: its pseudo-gradient would poison every peer.

        A step lands an overlapped round or starts one, never both: a peer told to stop at a round (--stop-at-epoch)
        stops after the step that landed it, with no next round in flight."""
        self.finite_steps.add(finite)
        landed = self.flight is not None and self.flight.finished.is_set()
        changed = self._take_corrections()
        if not self.finite_steps.settled():
            return self._restart_from_outer(samples)
        self.samples += samples
        self.inner_steps_since_round += 1
        if self.flight is not None:
            self.flight.inner_steps += 1
            if not self._next_round_due():
                # still this round's samples to the others: they may not have started it yet
                self.tracker.report_local_progress(self.flight.round, int(self.flight.weight) + self.samples)
                self._maybe_schedule_round()
                return changed
            landed = changed = self.finish_round()  # this peer's next round is due: the last one must land first
        self.tracker.report_local_progress(self._progress_round(), self.samples)
        if landed:
            self._maybe_schedule_round()
            return changed
        if self.tracker.global_epoch > self.outer.round:
            logger.warning(f"Missed outer round {self.outer.round}: loading the swarm's state")
            self.rounds_missed += 1
            self.load_state_from_peers()
            return True
        if not self.round_due:
            self._maybe_schedule_round()
            return changed
        if not self.finite_steps.settled(wait=True):  # the round reads the parameters: every step's verdict first
            return self._restart_from_outer(0)
        if self.overlap:
            self.start_round()
            return changed
        self.run_round()
        return True

    def _restart_from_outer(self, uncounted: int) -> bool:
        """Back to the outer parameters; `uncounted`: the samples of this step, not yet in `samples`."""
        logger.warning("Non-finite loss: restarting this peer's inner steps from the swarm's outer parameters")
        self.restarts += 1
        self.finish_round()
        self.samples_discarded += self.samples + uncounted
        self.outer.copy_to(self.parameters)
        self._begin_inner_steps()
        self.tracker.report_local_progress(self._progress_round(), 0)
        return True

    @property
    def round_due(self) -> bool:
        """Rounds paced in seconds: the clock reached this round's time on the grid, and this peer trained since its
        last round. Otherwise: samples the peers reported for this round (this peer's own counted at once) reach the
        target. hivemind's own readiness also fires on an estimated time of arrival, which let a peer that had just
        joined start a round at its first step, before the others were due."""
        if self.next_round_at is not None:
            return self.samples > 0 and time.time() >= self.next_round_at
        target = self.tracker.target_batch_size
        if self.tracker.global_progress.samples_accumulated >= target:
            return True
        # A peer reads the others' records every half second at best, and a round of fast peers can be as short (the
        # demo's: about 0.3 s of compute): counted from the records as read, each of two peers trained the round's
        # whole target by itself, 2H inner steps and more. Carried forward at their rates, they count what the
        # others have trained since.
        others = self.tracker.others_samples(self.outer.round, self.round_began, get_dht_time())
        return self.samples > 0 and self.samples + others >= target

    def _next_round_due(self) -> bool:
        """While a round is in flight: whether this peer's next one is due already (it must wait for the last).

        Rounds paced in seconds wait only for a group that waits for this peer: one looked for ahead and found,
        whose groupmates send their parts as their rounds fall due. Otherwise a round still in flight at the grid's
        time for the next one moves that one to the grid's next time, and the peer trains on meanwhile. Waiting for
        the landing and then starting at once, alone, put the peer off the others' grid for good: each of its rounds
        then started a grid time before theirs and looked for them until they came (`make demo` at 6559770: a peer
        whose first round fell due after one step had none of its 6 groups ready when due, its rounds in flight
        1.5-2.3 s of each 2 s, and it trained 36% fewer samples than its groupmate)."""
        if self.next_round_at is not None:
            if time.time() < self.next_round_at:
                return False
            if self.scheduled is not None and self.scheduled[1].stage == AveragingStage.AWAITING_TRIGGER:
                return True
            self.next_round_at = next_round_time(time.time(), self.round_seconds)
            return False
        return self.inner_steps_since_round >= self.inner_steps

    def _begin_inner_steps(self) -> None:
        """A round started, landed or was replaced by a state: count this peer's inner steps toward the next one."""
        self.samples = self.inner_steps_since_round = 0
        self.round_began = get_dht_time()  # DHT time, as the progress records state theirs
        self.finite_steps.clear()  # about parameters that are now the outer ones, or already read for a round
        if self.round_seconds:
            self.next_round_at = next_round_time(time.time(), self.round_seconds)

    def _maybe_schedule_round(self) -> None:
        """Between two inner steps: once the next round's group forms within a matchmaking time (_group_forms_at),
        start looking for it, so that matchmaking leaves the round's critical path. Beside a round in flight, once
        that round has found its group (OuterState.group_found): an overlapped round is in flight nearly all the
        time, and waiting for it to land left no time to look ahead (the demo's paced peers: no group ready in any
        round)."""
        if self.scheduled is not None:
            return
        if self.next_round_at is None and self.overlap:
            return  # counted overlapped rounds: see _group_forms_at
        if self.flight is not None and not self.outer.group_found(self.flight.round):
            return
        forms = self._group_forms_at()
        if forms is None or self._others_due() is None or time.time() < forms - self.matchmaking_time:
            return
        self.outer.expect_peers(self.num_peers)
        try:
            self.scheduled = (self.outer.round, self.outer.schedule_round(forms, self.averaging_timeout))
        except Exception as e:  # the averager shutting down under it: the round looks for its group when due
            logger.debug(f"Could not look ahead for outer round {self.outer.round}'s group: {type(e).__name__}: {e}")

    def _group_forms_at(self) -> Optional[float]:
        """When the next round's group forms (a Unix time), None while not known.

        Rounds paced in seconds: half a matchmaking time before the grid's time (group_time). Rounds counted in
        samples: when the swarm's samples reach the round's target, as hivemind's tracker estimates it from the
        peers' records, each carried forward from the time it states), about the same time on every peer however
        far apart their reads (searches begun at the read that saw the round due started a second or more apart on
        a busy machine). Blocking rounds only: overlapped ones counted in samples fall due as the round in flight
        lands, when the others' records still count that round's samples and the estimate is no guide (looking
        ahead there tripled the rounds that found no group in test_diloco_swarm's swarm)."""
        if self.next_round_at is not None:
            return group_time(self.next_round_at, self.matchmaking_time)
        progress = self.tracker.global_progress
        if progress.epoch != self.outer.round or not math.isfinite(progress.eta_next_epoch):
            return None
        return progress.eta_next_epoch

    def _take_scheduled(self) -> Optional[StepControl]:
        """The group looked for ahead for the round starting now: the one looked for at this round, or, where rounds
        look for their groups under one key (not OuterState.groups_by_round), the one looked for at any round. A
        round in flight can land this peer a round beyond the one it looked ahead for (brought
        up by a groupmate that was a round ahead, such as a joiner catching up). Its groupmates there wait for its
        part: cancelled, their all-reduce waited out its chunk timeout and the round failed for all (`make demo`'s
        two peers ended 0.086 apart)."""
        scheduled, self.scheduled = self.scheduled, None
        if scheduled is None:
            return None
        round_, control = scheduled
        if round_ == self.outer.round or not self.outer.groups_by_round:
            return control
        control.cancel()
        return None

    def cancel_scheduled(self) -> None:
        """Give up the group looked for ahead (leaving, or this peer's round changing under it)."""
        if self.scheduled is not None:
            self.scheduled[1].cancel()
            self.scheduled = None

    def _others_due(self) -> Optional[float]:
        """The averaging timeout when others train in the swarm; None when this peer is alone (its step only)."""
        return self.averaging_timeout if self.tracker.global_progress.num_peers > 1 else None

    def run_round(self) -> None:
        """A blocking round: take the outer step and average the outer parameters with whoever is in the round
        (alone: this peer's step only), then continue from them. A round that failed with others keeps this peer's
        own step: its parameters rejoin the others' at its next round together."""
        if not self.samples:
            return  # nothing trained since the last round: nothing to contribute (a zero weight)
        started = time.perf_counter()
        round_ = self.outer.round
        self.outer.expect_peers(self.num_peers)
        try:
            with self.tracker.pause_updates():
                self.last_round_steps = self.inner_steps_since_round
                result = self.outer.outer_step(self.parameters, weight=float(self.samples), timeout=self._others_due(),
                                               scheduled=self._take_scheduled())
                self.outer.copy_to(self.parameters)
                self._begin_inner_steps()
                self.tracker.update_epoch(self._progress_round())
            self.outer.advertise_round()
        finally:
            self.swarm_seconds += time.perf_counter() - started
        self._count_round(round_, result)

    def start_round(self) -> None:
        """An overlapped round: start it in the background and go on training (RoundInFlight)."""
        if not self.samples:
            return
        started = time.perf_counter()
        self.last_round_steps = self.inner_steps_since_round
        self.outer.expect_peers(self.num_peers)
        self.flight = RoundInFlight(self.outer, self.parameters, float(self.samples), self._others_due(),
                                    scheduled=self._take_scheduled())
        self._begin_inner_steps()
        self.swarm_seconds += time.perf_counter() - started

    def finish_round(self, timeout: Optional[float] = None) -> bool:
        """Wait (at most `timeout` seconds) for the overlapped round in flight, then land it: its corrections, the new
        round in the progress records. True when one landed."""
        if self.flight is None:
            return False
        started = time.perf_counter()
        finished = self.flight.finished.wait(timeout)
        waited = time.perf_counter() - started
        self.wait_seconds += waited
        self.swarm_seconds += waited
        return self._land_round() if finished else False

    def _take_corrections(self) -> bool:
        """Between two inner steps: the corrections of the round in flight that have arrived, and the round itself
        when it has finished. True when the parameters changed."""
        if self.flight is None:
            return False
        if self.flight.finished.is_set():
            return self._land_round()
        started = time.perf_counter()
        applied = self.flight.apply_corrections(self.parameters)
        self.swarm_seconds += time.perf_counter() - started
        return applied

    def _land_round(self) -> bool:
        started = time.perf_counter()
        flight, self.flight = self.flight, None
        flight.apply_corrections(self.parameters)
        self.communication_seconds += flight.seconds
        self.last_overlapped_steps = flight.inner_steps
        self.landed = (flight.round + 1, flight.digest, flight.probe) if flight.digest is not None else None
        with self.tracker.pause_updates():
            self.tracker.update_epoch(self._progress_round())
        self.tracker.report_local_progress(self._progress_round(), self.samples)
        self.outer.advertise_round()
        self.swarm_seconds += time.perf_counter() - started
        self._count_round(flight.round, flight.result)
        return True

    def _count_round(self, round_: int, result: Optional[bool]) -> None:
        self.rounds_group_ready += bool(self.outer.group_ready_when_due)
        if result is None:
            self.rounds_failed += 1
            logger.warning(f"Outer round {round_} could not be averaged with the swarm: this peer took its own step")
        elif result:
            self.rounds_averaged += 1
            logger.info(f"Outer round {round_}: averaged with the swarm")
        else:
            self.rounds_alone += 1
            logger.info(f"Outer round {round_}: alone")

    def stop_training(self) -> None:
        """Leaving, first step, once: withdraw this peer's progress record (the others stop counting it in their
        rounds at their next look) and land the round in flight, so that the state it still offers (until withdraw)
        is its last one."""
        if not self.progress_withdrawn:
            self.progress_withdrawn = True
            withdraw_records(self.outer.dht, self.tracker, [])
            self.cancel_scheduled()
            self.finish_round(timeout=GROUPMATES_WAIT)

    def withdraw(self) -> None:
        """Withdraw this peer's records, once: the others stop counting it at their next look."""
        if not self.withdrawn:
            self.withdrawn = True
            tracker = None if self.progress_withdrawn else self.tracker
            self.progress_withdrawn = True
            withdraw_records(self.outer.dht, tracker, [self.outer])

    def shutdown(self) -> None:
        """Leave: withdraw this peer's records (if not done at the first sign of leaving), let a round in flight
        finish, then stop."""
        self.withdraw()
        self.cancel_scheduled()
        # a round in flight has groupmates that wait for this peer's parts: let it finish, within reason
        self.finish_round(timeout=GROUPMATES_WAIT)
        if self.flight is None:  # the model leaves as the swarm's (--save-weights), without the steps since the round
            self.outer.copy_to(self.parameters)
        # The averager's shutdown first sends the groupmates of its last round the parts it reduced for them, which
        # they may still be reading (hivemind_internals.AnswersBeforeLeaving)
        self.outer.shutdown()
