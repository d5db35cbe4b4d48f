"""HivemindStrategy, our Lightning strategy for hivemind: one process per peer, gradients accumulated to the swarm's
target batch and averaged with whoever is training (hivetrain.swarm_optimizer), or DiLoCo rounds (hivetrain.diloco),
the LR schedule stepped on swarm epochs or rounds. hivetrain.diloco_ddp's DiLoCoDDPStrategy is one diloco peer on
several devices of one machine.

Written for Lightning 2.6 and hivemind 1.1.12 in place of the stale `lightning-hivemind` adapter: initial peers from
the argument or HIVETRAIN_INITIAL_PEERS really reach the DHT, client mode and relays are exposed, and fp16 training
gets hivemind's gradient scaler.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import hivemind
import lightning.pytorch as pl
import torch
from hivemind.optim.progress_tracker import ProgressTracker
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from hivetrain.coordinator_watch import CoordinatorWatch
from hivetrain.diloco import DiLoCoRounds
from hivetrain.hand_over import HAND_OVER_TIMEOUT, hand_over_from
from hivetrain.hivemind_internals import announce_and_count_peers, ask_cuda_availability_once
from hivetrain.robust import RobustAggregation
from hivetrain.rollback import RollbackRecord, wait_for_state
from hivetrain.swarm import DHTOptions, start_dht, withdraw_records
from hivetrain.swarm_optimizer import check_scheduler, schedule_per_inner_step, wrap_optimizer
from hivetrain.swarm_options import COMPRESSION, HivemindOptions

logger = logging.getLogger(__name__)


ask_cuda_availability_once()

class HivemindStrategy(SingleDeviceStrategy):
    """Train with a hivemind swarm. Give it a running `dht` or `DHTOptions` to start one.

    A peer is one process on one device (by default the current CUDA device where there is one, else the CPU): as
    Lightning's SingleDeviceStrategy it is its own rank zero, so it logs and shows progress, and reductions, barriers
    and broadcasts involve it alone. The swarm is hivemind's business, inside the optimizer step.

    The module brings one torch optimizer and at most one torch LR scheduler (any but ReduceLROnPlateau, which is
    refused at setup). How the scheduler advances:

    - sync mode: hivemind rebuilds optimizer and scheduler on its own copy of the parameters and steps the scheduler
      once per swarm epoch (one global optimizer step of `target_batch_size` samples), whatever interval and frequency
      the module configured. The swarm epoch is the one step count all peers share (a peer's own steps depend on its
      speed and on when it joined; a Lightning epoch is a pass over this peer's data only), so every peer has the same
      LR at the same epoch, and a joining peer replays the schedule up to the swarm's epoch (SwarmSchedule). Lengths in
      the schedule (T_max, total_steps, milestones) count swarm epochs.
    - diloco mode: the module's optimizer takes the inner steps as Lightning runs them, and its scheduler steps after
      every inner step (interval "step"); after each round it stands at least at round x inner_steps, so a slow or late
      peer continues the swarm's schedule rather than its own.

    With gradient accumulation, one optimizer step counts accumulate_grad_batches batches' samples. Manual optimization
    is refused at setup: the swarm's step is the optimizer step that Lightning runs for the module.

    setup replaces the trainer's optimizers and schedulers (and, for fp16 or reuse_grad_buffers, the precision
    plugin's scaler and the module's optimizer_zero_grad); teardown puts them back, so the module can be fit again,
    with this strategy or another.
    """

    def __init__(
        self,
        options: HivemindOptions,
        dht: Optional[hivemind.DHT] = None,
        network: Optional[DHTOptions] = None,
        device: Optional[torch.device] = None,
    ):
        if options.mode not in ("sync", "diloco"):
            raise ValueError(f"mode {options.mode!r} is not 'sync' or 'diloco'")
        if options.delay_grad_averaging and not options.delay_optimizer_step:
            raise ValueError("delay_grad_averaging requires delay_optimizer_step")
        if options.delay_optimizer_step and not options.offload_optimizer:
            raise ValueError("delay_optimizer_step requires offload_optimizer")
        self._owns_dht = dht is None
        self._network = network or DHTOptions()
        self.dht = dht if dht is not None else start_dht(self._network)
        # after the DHT's process has forked: asking for the current CUDA device initialises CUDA in this process.
        # A "cuda" without an index means the current one: Lightning's CUDA accelerator calls torch.cuda.set_device,
        # which refuses a device without an index (seen on an H200 with peers/join.py --device cuda).
        if device is None:
            device = _default_device()
        elif device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(device=device)
        self.options = options
        self._dht_shut_down = False  # an own DHT goes at teardown; a later fit with this strategy starts a new one
        self.optimizer: Optional[hivemind.Optimizer] = None  # sync mode
        self.rounds: Optional[DiLoCoRounds] = None  # diloco mode
        self._withdrawn = False  # sync mode: this peer's records are withdrawn (diloco: rounds.withdrawn)
        self._progress_withdrawn = False  # sync mode: its progress record is (stop_training_in_swarm)
        self._took_swarm_state = False  # the download at setup took a holder's state (catch_up_with_swarm)
        self._replaced: Optional[_ReplacedForSwarm] = None  # what setup replaced, put back at teardown
        self._watch: Optional[CoordinatorWatch] = None
        self.last_rollback: Optional[RollbackRecord] = None  # the coordinator's last rollback this peer took
        self.rollbacks_taken = 0

    # --- the swarm ----------------------------------------------------------------------------------------------

    @property
    def local_epoch(self) -> int:
        """The swarm epoch this peer is at: swarm optimizer steps (sync) or outer rounds (diloco)."""
        if self.rounds is not None:
            return self.rounds.round
        return self.optimizer.local_epoch if self.optimizer is not None else 0

    @property
    def tracker(self) -> Optional[ProgressTracker]:
        """hivemind's progress tracker of this peer (None before setup)."""
        if self.rounds is not None:
            return self.rounds.tracker
        return self.optimizer.tracker if self.optimizer is not None else None

    @property
    def num_peers(self) -> int:
        """Training peers the swarm's progress records show; at least this one, also before its first record."""
        return max(1, self.tracker.global_progress.num_peers) if self.tracker is not None else 1

    @property
    def epoch_samples(self) -> int:
        """Samples the swarm trains per swarm epoch: the target batch (sync), or H x batch x peers (diloco)."""
        return self.tracker.target_batch_size if self.tracker is not None else self.options.target_batch_size

    @property
    def swarm_seconds(self) -> float:
        """Wall time this peer spent in swarm rounds and state downloads rather than on its own batches."""
        swarm = self.rounds or self.optimizer
        return swarm.swarm_seconds if swarm is not None else 0.0

    @property
    def missed_rounds(self) -> int:
        """Swarm rounds this peer missed or could not average (it went on with its own step)."""
        swarm = self.rounds or self.optimizer
        return swarm.missed_rounds if swarm is not None else 0

    @property
    def samples_discarded(self) -> int:
        """Samples this peer trained that never reached the swarm: steps dropped out of sync or non-finite, epochs or
        inner steps replaced by the swarm's state (SwarmOptimizer, DiLoCoRounds)."""
        swarm = self.rounds or self.optimizer
        return swarm.samples_discarded if swarm is not None else 0

    def load_state_from_peers(self) -> bool:
        """Take the swarm's newest state; whether a holder served one."""
        if self.rounds is not None:
            taken = self.rounds.load_state_from_peers()
            self._follow_swarm_schedule()
            return taken
        return self.optimizer.load_state_from_peers()

    def catch_up_with_swarm(self) -> None:
        """Load the swarm's state if its progress records are beyond this peer's epoch, or the download at setup found
        no holder (a coordinator resumed from a checkpoint may not have served yet). A peer that took the state at
        setup and then waited for others holds the swarm's state still unless one of them stepped meanwhile: a second
        download would bring nothing, at the cost of the model and its optimizer state over the volunteer's link."""
        if self.tracker is not None and (not self._took_swarm_state or self.tracker.global_epoch > self.local_epoch):
            self._took_swarm_state = self.load_state_from_peers()

    def announce_and_count_peers(self) -> int:
        """Training peers in the run's progress records, this one included, client-mode peers too (the coordinator
        publishes none).

        hivemind publishes a peer's progress only once it has samples, and a tracker that has seen nobody looks again
        only seconds later: peers that start together would each take their first epochs alone. A peer waiting for
        others publishes its empty progress itself and hands what it reads to its tracker, so that from the first step
        on the tracker counts the others and the first epoch is averaged.
        """
        return announce_and_count_peers(self.dht, self.tracker)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if self._dht_shut_down:  # fit again after a fit: the strategy's own DHT went at that fit's teardown
            self.dht = start_dht(self._network)
            self._dht_shut_down = False
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        refuse_what_a_swarm_cannot_train(self, trainer)
        schedulers = [config.scheduler for config in self.lr_scheduler_configs]
        self._replaced = _ReplacedForSwarm.take(self)
        self.options = samples_per_optimizer_step(self.options, trainer)
        if self.options.coordinator_key is not None:
            self._watch = CoordinatorWatch(self.dht, self.options.run_id, self.options.coordinator_key)
        if self.options.mode == "diloco":
            self.lr_scheduler_configs = schedule_per_inner_step(self.lr_scheduler_configs)
            self._setup_diloco()
            return
        for config in self.lr_scheduler_configs:
            if (config.interval, config.frequency) != ("step", 1):
                logger.info(f"The LR scheduler steps once per swarm epoch, not per {config.frequency} "
                            f"{config.interval}(s)")
        use_fp16 = isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.precision == "16-mixed"
        if use_fp16:
            # Plain torch scaling breaks with hivemind's accumulation; hivemind's scaler unscales once per swarm step.
            self.options = dataclasses.replace(self.options, reuse_grad_buffers=True)
            self.precision_plugin.scaler = hivemind.GradScaler(device=self.precision_plugin.device)
        self.optimizer = wrap_optimizer(self.options, self.dht, self.optimizers[0], schedulers[0] if schedulers else None)
        if self._watch is not None:
            self._watch.bound(self.optimizer.tracker, self.optimizer.state_averager)
        self._withdrawn = self._progress_withdrawn = False
        # The scheduler now steps inside hivemind, once per swarm epoch: Lightning must not step it per batch.
        self.lr_scheduler_configs = []
        self.optimizers = [self.optimizer]
        if self.options.reuse_grad_buffers:
            # hivemind resets the accumulated .grad itself after each swarm step; zeroing them would lose samples.
            self.lightning_module.optimizer_zero_grad = _keep_gradients
        logger.info("Loading the swarm's state before the first step")
        self._took_swarm_state = self.load_state_from_peers()
        logger.info(f"Joined the swarm at epoch {self.local_epoch}")

    def _setup_diloco(self) -> None:
        """The module's own optimizer and scheduler take the inner steps, as Lightning runs them; the rounds come
        after an optimizer step (optimizer_step)."""
        self.rounds = make_rounds(self.options, self.dht, list(self.lightning_module.parameters()))
        if self._watch is not None:
            self._watch.bound(self.rounds.tracker, self.rounds.outer)
        logger.info("Loading the swarm's outer state before the first step")
        self._took_swarm_state = self.load_state_from_peers()
        logger.info(f"Joined the swarm at outer round {self.local_epoch}")

    def _follow_swarm_schedule(self, in_optimizer_step: bool = False) -> None:
        """The inner LR schedule follows the swarm, not this peer's own step count: after round r it stands at least
        at r x H steps, so a late joiner, or a slow peer that took fewer inner steps, continues the swarm's schedule."""
        advance_schedules(self.lr_scheduler_configs, self.rounds.round * self.options.inner_steps, in_optimizer_step)

    @override
    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.rounds is not None and output is not None:  # None: training_step returned None, nothing was trained
            restarts = self.rounds.restarts
            # the verdict stays on the device: read on the host now, it would stall the GPU at every step
            if self.rounds.after_inner_step(self.options.batch_size, finite=torch.isfinite(output).all()):
                if self.rounds.restarts != restarts:
                    optimizer.state.clear()  # the inner optimizer's statistics took the non-finite gradients too
                self._follow_swarm_schedule(in_optimizer_step=True)
        self._follow_coordinator(optimizer)
        return output

    def _follow_coordinator(self, optimizer) -> None:
        """Between two steps: when the coordinator has rolled the swarm back, load the state it serves (numbered ahead
        of this peer's, so hivemind takes it as the newest); when this peer ran ahead of the coordinator's clock (it
        trained alone while cut off: hivetrain.coordinator_watch), load the swarm's state, behind its own."""
        record = self._watch.rollbacks.take(self.local_epoch) if self._watch is not None else None
        if record is not None:
            averager = self.rounds.outer if self.rounds is not None else self.optimizer.state_averager
            with averager.downloading_only_from(self._watch.holder):  # the coordinator's state, no peer's
                if self.rounds is not None:
                    reached = wait_for_state(self.rounds.load_state_from_peers, lambda: self.rounds.round, record)
                else:
                    reached = wait_for_state(self.optimizer.load_state_from_peers, lambda: self.optimizer.local_epoch,
                                             record)
            if reached:  # else wait_for_state said why, and the next validation decides again
                self.last_rollback, self.rollbacks_taken = record, self.rollbacks_taken + 1
        elif self._watch is not None and (clock := self._watch.ran_ahead(self.local_epoch)) is not None:
            if self.rounds is not None:
                self.rounds.load_state_from_peers()  # on no state, it keeps its round (and tries again)
            else:
                self.optimizer.step_back_to(clock)  # on no state, it keeps its epoch (and tries again)
        else:
            return
        if self.rounds is not None:
            optimizer.state.clear()  # the inner statistics belong to the training that went wrong, or went alone
            self._follow_swarm_schedule(in_optimizer_step=True)

    def stop_training_in_swarm(self) -> None:
        """Leaving, first step: withdraw this peer's progress record, so the others stop counting it in their rounds
        at their next look, and land a diloco round in flight. Its offer to share its state stays up (hand_over_state)
        until leave_swarm. Call it at the first sign of leaving (SwarmProgress does, before its goodbye record)."""
        if self.rounds is not None:
            self.rounds.stop_training()
        elif self.optimizer is not None and not self._progress_withdrawn:
            self._progress_withdrawn = True
            withdraw_records(self.dht, self.optimizer.tracker, [])

    def hand_over_state(self, report: Callable[[str], None], timeout: float = HAND_OVER_TIMEOUT) -> Optional[bool]:
        """After the goodbye record: when no other peer trains, keep this peer's state up until the coordinator holds
        it, `timeout` seconds at most (hivetrain.hand_over, whose answer this is). A peer in client mode serves no
        state: nothing to wait for."""
        epoch = self.rounds.outer.round if self.rounds is not None else self.local_epoch  # that of the state served
        return hand_over_from(self.dht, self.options.run_id, epoch, self._watch, report, timeout)

    def leave_swarm(self) -> None:
        """Withdraw this peer's records now, once: the others stop counting it at their next look, and no longer wait
        on it, group with it or download from it. SwarmProgress calls it once the state is handed over; teardown calls
        it too. hivemind's own goodbye does not wait for the DHT."""
        if self.rounds is not None:
            self.rounds.withdraw()
        elif self.optimizer is not None and not self._withdrawn:
            self._withdrawn = True
            tracker = None if self._progress_withdrawn else self.optimizer.tracker
            self._progress_withdrawn = True
            withdraw_records(self.dht, tracker, [self.optimizer.state_averager])

    @override
    def on_exception(self, exception: BaseException) -> None:
        if isinstance(exception, KeyboardInterrupt):  # Ctrl-C or SIGTERM: leaving
            self.leave_swarm()
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        # The averagers use the DHT: shut them down first, then the DHT (the reverse order hangs).
        if self.optimizer is not None:
            self.leave_swarm()
            self.optimizer.shutdown()
            self.optimizer = None
        if self.rounds is not None:
            self.rounds.shutdown()
            self.rounds = None
        if self._replaced is not None:
            self._replaced.put_back(self)
            self._replaced = None
        if self._owns_dht and not self._dht_shut_down:
            self.dht.shutdown()
            self._dht_shut_down = True
        super().teardown()


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def refuse_what_a_swarm_cannot_train(strategy: pl.strategies.Strategy, trainer: pl.Trainer) -> None:
    """At setup, refuse what a module brings that the swarm cannot train with, saying what to do instead."""
    name = type(strategy).__name__
    if not trainer.lightning_module.automatic_optimization:
        # Lightning's manual optimization hands the optimizer step a closure that trains nothing: the swarm's step
        # would never run, and the peer would train alone without a word.
        raise ValueError(f"{name} needs automatic optimization: the swarm averages inside the optimizer step that"
                         " Lightning runs for you. Return the loss from training_step and leave"
                         " automatic_optimization on.")
    # (one optimizer: Lightning refuses several without manual optimization)
    if len(strategy.lr_scheduler_configs) > 1:
        raise ValueError(f"{name} supports at most one LR scheduler (a SequentialLR or ChainedScheduler can combine"
                         " several)")
    for config in strategy.lr_scheduler_configs:
        check_scheduler(config.scheduler, strategy.optimizers[0])


def samples_per_optimizer_step(options: HivemindOptions, trainer: pl.Trainer) -> HivemindOptions:
    """The options with the samples behind one optimizer step: with gradient accumulation Lightning steps once per
    accumulate_grad_batches batches, and the swarm must count all of them toward its epochs and rounds."""
    return dataclasses.replace(options, batch_size=options.batch_size * trainer.accumulate_grad_batches)


def _keep_gradients(*args: Any, **kwargs: Any) -> None:
    pass


@dataclass
class _ReplacedForSwarm:
    """What HivemindStrategy.setup replaces on the strategy, its precision plugin and the user's LightningModule to
    train in sync mode, as it was before: teardown puts it back, so that the module, the trainer's optimizers and the
    strategy are the user's again (another fit, with this strategy or any other, starts from them)."""

    options: HivemindOptions
    optimizers: list[torch.optim.Optimizer]
    lr_scheduler_configs: list
    scaler: Any  # the precision plugin's gradient scaler (16-mixed), or None where the plugin has none
    module: pl.LightningModule
    own_zero_grad: Any  # an optimizer_zero_grad set on the module instance itself, or _NOT_SET

    @classmethod
    def take(cls, strategy: HivemindStrategy) -> _ReplacedForSwarm:
        module = strategy.lightning_module
        return cls(strategy.options, list(strategy.optimizers), list(strategy.lr_scheduler_configs),
                   getattr(strategy.precision_plugin, "scaler", None), module,
                   vars(module).get("optimizer_zero_grad", _NOT_SET))

    def put_back(self, strategy: HivemindStrategy) -> None:
        strategy.options = self.options
        strategy.optimizers = self.optimizers
        strategy.lr_scheduler_configs = self.lr_scheduler_configs
        if hasattr(strategy.precision_plugin, "scaler"):
            strategy.precision_plugin.scaler = self.scaler
        if self.own_zero_grad is _NOT_SET:
            vars(self.module).pop("optimizer_zero_grad", None)  # the class's hook shows through again
        else:
            self.module.optimizer_zero_grad = self.own_zero_grad


_NOT_SET = object()


def make_rounds(options: HivemindOptions, dht: hivemind.DHT, parameters: list[torch.nn.Parameter]) -> DiLoCoRounds:
    return DiLoCoRounds(
        dht, options.run_id, parameters, inner_steps=options.inner_steps,
        batch_size=options.batch_size, outer_lr=options.outer_lr, outer_momentum=options.outer_momentum,
        matchmaking_time=options.matchmaking_time, averaging_timeout=options.averaging_timeout,
        next_chunk_timeout=options.next_chunk_timeout, compression=COMPRESSION[options.grad_compression](),
        state_compression=COMPRESSION[options.state_compression](), load_state_timeout=options.load_state_timeout,
        aggregation=RobustAggregation.for_swarm(options),
        target_group_size=options.target_group_size, overlap=options.overlap_rounds,
        round_seconds=options.round_seconds,
    )


def advance_schedules(lr_scheduler_configs: list, steps: int, in_optimizer_step: bool) -> None:
    """Step each LR scheduler until it stands at least at `steps`. Inside an optimizer step, one short: Lightning
    steps the schedulers (interval "step", schedule_per_inner_step) right after it, for the step just taken."""
    steps -= int(in_optimizer_step)
    for config in lr_scheduler_configs:
        with warnings.catch_warnings():  # a joiner advances its schedule before its first optimizer step
            warnings.simplefilter("ignore", UserWarning)
            while _steps_taken(config.scheduler) < steps:
                config.scheduler.step()


def _steps_taken(scheduler: torch.optim.lr_scheduler.LRScheduler) -> int:
    """A scheduler's last_epoch; a ChainedScheduler keeps none, and its links all step with it: its first link's."""
    while isinstance(scheduler, torch.optim.lr_scheduler.ChainedScheduler):
        scheduler = scheduler._schedulers[0]
    return scheduler.last_epoch
