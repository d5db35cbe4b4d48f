"""DiLoCoDDPStrategy: one diloco peer whose inner steps run with DDP across several devices of one machine, while it
joins the swarm as one peer (HivemindStrategy, hivetrain.strategy, is the one-device peer)."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any, Callable, Optional

import hivemind
import lightning.pytorch as pl
import torch
from hivemind.optim.progress_tracker import ProgressTracker
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from hivetrain.coordinator_watch import CoordinatorWatch
from hivetrain.diloco import DiLoCoRounds
from hivetrain.hand_over import HAND_OVER_TIMEOUT, hand_over_from
from hivetrain.hivemind_internals import announce_and_count_peers
from hivetrain.rollback import RollbackRecord, wait_for_state
from hivetrain.strategy import (advance_schedules, make_rounds, refuse_what_a_swarm_cannot_train,
                                samples_per_optimizer_step)
from hivetrain.swarm_optimizer import schedule_per_inner_step
from hivetrain.swarm_options import HivemindOptions

logger = logging.getLogger(__name__)


class DiLoCoDDPStrategy(DDPStrategy):
    """One diloco peer on several devices of one machine: its inner steps run with DDP across them (one process per
    device), and it joins the swarm as ONE peer with one identity.

    Global rank 0 is the peer: it alone holds the DHT (give it `dht`; the other ranks get None) and the DiLoCoRounds,
    publishes progress and takes part in the rounds. The other ranks never touch the swarm. Each round is weighted by
    the samples of all ranks (batch x world size per inner step), while the round rule counts H x the run's batch per
    peer, as every other peer counts it. After each inner optimizer step the ranks agree whether it was finite, rank 0
    runs its side of the round, and tells the others whether the parameters changed to a new outer state and which
    round the swarm is at; when they changed, every rank takes rank 0's parameters. So all ranks always continue from
    the same outer parameters, follow the same inner LR schedule (round x H) and know the same `local_epoch`.

    `announce_and_count_peers` and `load_state_from_peers` are collective: every rank calls them, rank 0 does the work.
    The swarm accessors (tracker, num_peers, epoch_samples, swarm_seconds, dht) mean something on rank 0 only.
    Each rank reads a different shard of the data: a DistributedSampler seeded with `data_seed` (one seed per peer,
    so peers see different orders).
    """

    def __init__(self, options: HivemindOptions, dht: Optional[hivemind.DHT] = None, data_seed: int = 0,
                 **ddp_kwargs: Any):
        if options.mode != "diloco":
            raise ValueError(f"{type(self).__name__} trains diloco runs only, not mode {options.mode!r}")
        super().__init__(**ddp_kwargs)
        self.options, self.dht, self.data_seed = options, dht, data_seed
        self.rounds: Optional[DiLoCoRounds] = None  # rank 0
        self._round = 0  # the swarm's outer round, as rank 0 last told every rank
        self._own_sigterm_handler: Any = None  # the process's SIGTERM handler before Lightning's
        self._given: Optional[tuple] = None  # (options, LR scheduler configs) as they were before setup replaced them
        self._watch: Optional[CoordinatorWatch] = None  # rank 0, when the coordinator's key is known
        self.last_rollback: Optional[RollbackRecord] = None  # rank 0: the coordinator's last rollback this peer took
        self.rollbacks_taken = 0  # every rank
        self._took_swarm_state = False  # rank 0: the download at setup took a holder's state (catch_up_with_swarm)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return dict(super().distributed_sampler_kwargs, seed=self.data_seed)

    # --- the swarm (accessors as HivemindStrategy's) --------------------------------------------------------------

    @property
    def local_epoch(self) -> int:
        """The outer round this peer is at, the same on every rank."""
        return self._round

    @property
    def tracker(self) -> Optional[ProgressTracker]:
        return self.rounds.tracker if self.rounds is not None else None

    @property
    def num_peers(self) -> int:
        return max(1, self.tracker.global_progress.num_peers) if self.tracker is not None else 1

    @property
    def epoch_samples(self) -> int:
        """Samples the swarm trains per outer round: H x batch x peers."""
        if self.tracker is not None:
            return self.tracker.target_batch_size
        return self.options.inner_steps * self.options.batch_size

    @property
    def swarm_seconds(self) -> float:
        return self.rounds.swarm_seconds if self.rounds is not None else 0.0

    @property
    def missed_rounds(self) -> int:
        return self.rounds.missed_rounds if self.rounds is not None else 0

    @property
    def samples_discarded(self) -> int:
        return self.rounds.samples_discarded if self.rounds is not None else 0

    def load_state_from_peers(self) -> bool:
        """Collective: rank 0 downloads the swarm's outer state, every rank continues from it; whether a holder
        served one (rank 0 knows)."""
        taken = self.rounds.load_state_from_peers() if self.rounds is not None else False
        self._share_outer_state(changed=True, in_optimizer_step=False)
        return taken

    def catch_up_with_swarm(self) -> None:
        """Collective: rank 0 says whether the swarm's records are beyond this peer's round or its download at setup
        found no holder (HivemindStrategy's), and every rank loads the outer state if so."""
        ahead = self.rounds is not None and (not self._took_swarm_state
                                             or self.tracker.global_epoch > self.local_epoch)
        if self._broadcast_ints(int(ahead))[0]:
            self._took_swarm_state = self.load_state_from_peers()

    def announce_and_count_peers(self) -> int:
        """Collective: rank 0 announces this peer and counts the training peers (HivemindStrategy's), every rank
        gets the count."""
        count = announce_and_count_peers(self.dht, self.tracker) if self.rounds is not None else 0
        return self._broadcast_ints(count)[0]

    # --- Lightning ------------------------------------------------------------------------------------------------

    @override
    def configure_ddp(self) -> None:
        # Rank 0 joins and loads the swarm's outer state before DDP wraps the model: DDP starts by broadcasting rank 0's
        # parameters to the others.
        if self.is_global_zero:
            if self.dht is None:
                raise ValueError(f"{type(self).__name__}: global rank 0 talks to the swarm and needs the DHT")
            self.rounds = make_rounds(self.options, self.dht, list(self.lightning_module.parameters()))
            if self.options.coordinator_key is not None:
                self._watch = CoordinatorWatch(self.dht, self.options.run_id, self.options.coordinator_key)
                self._watch.bound(self.rounds.tracker, self.rounds.outer)
            logger.info("Loading the swarm's outer state before the first step")
            self._took_swarm_state = self.rounds.load_state_from_peers()
            logger.info(f"Joined the swarm at outer round {self.rounds.round}")
        self._round = self._broadcast_ints(self.rounds.round if self.rounds is not None else 0)[0]
        super().configure_ddp()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:  # before DDP's set-up, which builds the rounds (configure_ddp); teardown puts both back
            self._given = (self.options, None)
            self.options = samples_per_optimizer_step(self.options, trainer)
        super().setup(trainer)
        if not fitting:
            return
        refuse_what_a_swarm_cannot_train(self, trainer)
        self._given = (self._given[0], list(self.lr_scheduler_configs))
        self.lr_scheduler_configs = schedule_per_inner_step(self.lr_scheduler_configs)
        advance_schedules(self.lr_scheduler_configs, self._round * self.options.inner_steps, in_optimizer_step=False)
        self._own_sigterm_handler = signal.getsignal(signal.SIGTERM)  # Lightning installs its own after setup

    @override
    def on_train_start(self) -> None:
        # Lightning's SIGTERM handler forwards the signal to the other ranks and broadcasts from inside the handler:
        # wherever the signal lands, that broadcast pairs with another rank's next collective of this strategy or
        # of DDP, and the ranks' collectives no longer match. The process's own handler stays instead: on rank 0 it
        # leaves (KeyboardInterrupt), and on_exception stops the other ranks.
        if self._own_sigterm_handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._own_sigterm_handler)

    @override
    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        trained = output is not None  # None: training_step returned None, nothing was trained
        finite = not trained or bool(torch.isfinite(output).all())
        # Every rank takes part, whatever its own step did: [ranks with a non-finite step, samples of all ranks].
        tally = torch.tensor([0 if finite else 1, self.options.batch_size if trained else 0], dtype=torch.int64,
                             device=self.root_device)
        torch.distributed.all_reduce(tally)
        non_finite, samples = tally.tolist()
        changed = False
        if self.rounds is not None and (samples or non_finite):
            changed = self.rounds.after_inner_step(samples, finite=not non_finite)
        taken, reached = self._follow_coordinator()
        # a rollback's downloads replace rank 0's parameters even when they fall short of the served state
        changed, taken, reached = self._share_outer_state(changed or taken, in_optimizer_step=True, taken=taken,
                                                          reached=reached)
        if changed and non_finite or taken:
            # the inner optimizer's statistics took the non-finite gradients too, or belong to the training that
            # went wrong (HivemindStrategy._follow_coordinator clears them for any state it loads, too)
            optimizer.state.clear()
        return output

    def _follow_coordinator(self) -> tuple[bool, bool]:
        """Rank 0, between two inner steps: when the coordinator has rolled the swarm back, load the state it serves;
        when this peer ran ahead of its clock, the swarm's state (HivemindStrategy._follow_coordinator). Returns (a
        state was loaded or tried, this peer now holds the rolled-back state); the ranks learn both with the state."""
        record = self._watch.rollbacks.take(self.rounds.round) if self._watch is not None else None
        if record is not None:
            with self.rounds.outer.downloading_only_from(self._watch.holder):  # the coordinator's state, no peer's
                reached = wait_for_state(self.rounds.load_state_from_peers, lambda: self.rounds.round, record)
            if reached:
                self.last_rollback = record
            return True, reached
        if self._watch is not None and self._watch.ran_ahead(self.rounds.round, unit="outer round") is not None:
            self.rounds.load_state_from_peers()
            return True, False
        return False, False

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Rank 0 leaves early (Ctrl-C, SIGTERM, an error): the ranks it launched stop at once. Lightning would kill
        them only after its teardown, and its process observer, seeing them killed, would then kill this process
        too, in the middle of its goodbye to the swarm."""
        launched = getattr(self.launcher, "procs", None)  # Lightning's subprocess launcher, on rank 0
        if launched:
            stopping = list(launched)
            launched.clear()  # the observer and Lightning's own kill share this list: they find nothing left to do
            for process in stopping:
                process.kill()  # a rank waiting in a collective for rank 0 would not see a gentler signal
                process.wait()
        if isinstance(exception, KeyboardInterrupt):  # Ctrl-C or SIGTERM: leaving
            self.leave_swarm()
        super().on_exception(exception)

    def stop_training_in_swarm(self) -> None:
        """Rank 0 withdraws this peer's progress record and lands its round in flight
        (HivemindStrategy.stop_training_in_swarm)."""
        if self.rounds is not None:
            self.rounds.stop_training()

    def hand_over_state(self, report: Callable[[str], None], timeout: float = HAND_OVER_TIMEOUT) -> Optional[bool]:
        """Rank 0 keeps this peer's state up until the coordinator holds it, when no other peer trains
        (HivemindStrategy.hand_over_state)."""
        if self.rounds is None:
            return None
        return hand_over_from(self.dht, self.options.run_id, self.rounds.outer.round, self._watch, report, timeout)

    def leave_swarm(self) -> None:
        """Rank 0 withdraws this peer's records now, once (HivemindStrategy.leave_swarm); other ranks hold none."""
        if self.rounds is not None:
            self.rounds.withdraw()

    def _share_outer_state(self, changed: bool, in_optimizer_step: bool, taken: bool = False, reached: bool = False
                           ) -> tuple[bool, bool, bool]:
        """Rank 0 tells every rank the swarm's round, whether the parameters changed to a new outer state, and whether
        a rollback was taken and its state reached; when they changed, every rank takes rank 0's parameters and moves
        its LR schedule to the round. Returns (changed, taken, reached), the same on every rank."""
        changed, self._round, taken, reached = self._broadcast_ints(
            int(changed), self.rounds.round if self.rounds is not None else 0, int(taken), int(reached))
        if changed:
            _sync_module_states(self.lightning_module)  # rank 0's parameters and buffers to every rank
            advance_schedules(self.lr_scheduler_configs, self._round * self.options.inner_steps, in_optimizer_step)
        self.rollbacks_taken += reached
        return bool(changed), bool(taken), bool(reached)

    def _broadcast_ints(self, *values: int) -> list[int]:
        tensor = torch.tensor(values, dtype=torch.int64, device=self.root_device)
        torch.distributed.broadcast(tensor, src=0)
        return tensor.tolist()

    @override
    def teardown(self) -> None:
        # The averager and tracker use the DHT, which belongs to the caller: they go, the DHT stays.
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        if self.rounds is not None:
            self.rounds.shutdown()
            self.rounds = None
        if self._given is not None:  # what setup replaced: the module can be fit again, with any strategy
            options, scheduler_configs = self._given
            self.options, self._given = options, None
            if scheduler_configs is not None:
                self.lr_scheduler_configs = scheduler_configs
        super().teardown()
