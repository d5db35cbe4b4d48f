"""Our Lightning strategies for hivemind. HivemindStrategy: one process per peer, gradients accumulated to the swarm's
target batch and averaged with whoever is training, the LR schedule stepped on swarm epochs (or DiLoCo rounds).
DiLoCoDDPStrategy: one diloco peer whose inner steps run with DDP across several devices of one machine.

Written for Lightning 2.6 and hivemind 1.1.12 in place of the stale `lightning-hivemind` adapter: initial peers from
the argument or HIVETRAIN_INITIAL_PEERS really reach the DHT, client mode and relays are exposed, and fp16 training
gets hivemind's gradient scaler.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import signal
import threading
import time
import types
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import hivemind
import lightning.pytorch as pl
import torch
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.compression import CompressionBase, Float16Compression, NoCompression, Uniform8BitQuantization
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from hivetrain.config import SwarmConfig
from hivetrain.coordinator_watch import CoordinatorWatch
from hivetrain.diloco import DiLoCoRounds
from hivetrain.hivemind_internals import PatchedOptimizer, announce_and_count_peers, ask_cuda_availability_once
from hivetrain.record_guard import VettedProgressTracker
from hivetrain.robust import RobustAggregation
from hivetrain.rollback import RollbackRecord, wait_for_state
from hivetrain.swarm import (RECORD_LIFETIME, DHTOptions, group_matchmaking, keeping_sigint, start_dht,
                             withdraw_records)

logger = logging.getLogger(__name__)


ask_cuda_availability_once()

COMPRESSION: dict[str, Callable[[], CompressionBase]] = {
    "none": NoCompression,
    "fp16": Float16Compression,
    "8bit": Uniform8BitQuantization,
}


@dataclass
class HivemindOptions:
    run_id: str
    target_batch_size: int  # samples the swarm accumulates per optimizer step
    batch_size: int  # this peer's samples per local step
    matchmaking_time: float = 3.0
    averaging_timeout: float = 30.0
    next_chunk_timeout: float = 5.0  # seconds before a silent peer's remaining parts are averaged without it
    grad_compression: str = "none"  # "none", "fp16", "8bit"
    state_compression: str = "none"  # for parameter averaging and state downloads
    average_state_every: int = 1  # swarm epochs between parameter averaging rounds
    delay_state_averaging: bool = False  # average parameters in the background (one epoch stale)
    delay_optimizer_step: bool = False  # run the optimizer in the background (needs offload_optimizer)
    delay_grad_averaging: bool = False  # average gradients in the background (needs delay_optimizer_step)
    offload_optimizer: bool = True  # keep optimizer state and a master copy of parameters in host memory
    reuse_grad_buffers: bool = False  # accumulate in .grad (saves memory); forced on for fp16 with hivemind's scaler
    load_state_timeout: float = 60.0
    verbose: bool = False  # hivemind's own progress messages
    # "sync": gradients averaged every swarm step (hivemind.Optimizer). "diloco": each peer takes about inner_steps
    # steps of its own optimizer, then the peers average the pseudo-gradient and take an outer SGD step with Nesterov
    # momentum (hivetrain.diloco); the gradient fields above (compression, delays, offload) are then unused but
    # grad_compression, which applies to the pseudo-gradient.
    mode: str = "sync"
    inner_steps: int = 50
    overlap_rounds: bool = False  # diloco: each round in the background while the next inner steps run
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    # How each all-reduce part combines the peers' copies (hivetrain.robust): "none" (hivemind's weighted mean),
    # "centered-clip" or "trimmed-mean", in both modes.
    robust_aggregation: str = "none"
    clip_radius: float = SwarmConfig.clip_radius
    trim_fraction: float = SwarmConfig.trim_fraction
    target_group_size: Optional[int] = None  # G: average in groups of at most G peers (None: one group), either mode
    # The subkey the run record was signed under (hivetrain.run_record.fetch_run): this peer goes back to the best
    # validated state when a rollback record signed by it says so (hivetrain.rollback). None: no rollbacks.
    coordinator_key: Optional[bytes] = None


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

    def load_state_from_peers(self) -> None:
        if self.rounds is not None:
            self.rounds.load_state_from_peers()
            self._follow_swarm_schedule()
        else:
            self.optimizer.load_state_from_peers()

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
        self._withdrawn = False
        # The scheduler now steps inside hivemind, once per swarm epoch: Lightning must not step it per batch.
        self.lr_scheduler_configs = []
        self.optimizers = [self.optimizer]
        if self.options.reuse_grad_buffers:
            # hivemind resets the accumulated .grad itself after each swarm step; zeroing them would lose samples.
            self.lightning_module.optimizer_zero_grad = _keep_gradients
        logger.info("Loading the swarm's state before the first step")
        self.optimizer.load_state_from_peers()
        logger.info(f"Joined the swarm at epoch {self.local_epoch}")

    def _setup_diloco(self) -> None:
        """The module's own optimizer and scheduler take the inner steps, as Lightning runs them; the rounds come
        after an optimizer step (optimizer_step)."""
        self.rounds = _make_rounds(self.options, self.dht, list(self.lightning_module.parameters()))
        if self._watch is not None:
            self._watch.bound(self.rounds.tracker, self.rounds.outer)
        logger.info("Loading the swarm's outer state before the first step")
        self.load_state_from_peers()
        logger.info(f"Joined the swarm at outer round {self.local_epoch}")

    def _follow_swarm_schedule(self, in_optimizer_step: bool = False) -> None:
        """The inner LR schedule follows the swarm, not this peer's own step count: after round r it stands at least
        at r x H steps, so a late joiner, or a slow peer that took fewer inner steps, continues the swarm's schedule."""
        _advance_schedules(self.lr_scheduler_configs, self.rounds.round * self.options.inner_steps, in_optimizer_step)

    @override
    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.rounds is not None and output is not None:  # None: training_step returned None, nothing was trained
            finite = bool(torch.isfinite(output).all())
            if self.rounds.after_inner_step(self.options.batch_size, finite=finite):
                if not finite:
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
            if self.rounds is not None:
                reached = wait_for_state(self.rounds.load_state_from_peers, lambda: self.rounds.round, record)
            else:
                reached = wait_for_state(self.optimizer.load_state_from_peers, lambda: self.optimizer.local_epoch,
                                         record)
            if reached:  # else wait_for_state said why, and the next validation decides again
                self.last_rollback, self.rollbacks_taken = record, self.rollbacks_taken + 1
        elif self._watch is not None and (clock := self._watch.ran_ahead(self.local_epoch)) is not None:
            logger.warning(f"This peer is at swarm epoch {self.local_epoch}, far beyond the coordinator's count"
                           f" ({clock}): it trained alone while cut off. Loading the swarm's state")
            if self.rounds is not None:
                self.rounds.load_state_from_peers()
            else:  # hivemind takes no state behind this peer's epoch: it steps back to the count first
                self.optimizer.state_averager.local_epoch = clock
                self.optimizer.load_state_from_peers()
        else:
            return
        if self.rounds is not None:
            optimizer.state.clear()  # the inner statistics belong to the training that went wrong, or went alone
            self._follow_swarm_schedule(in_optimizer_step=True)

    def leave_swarm(self) -> None:
        """Withdraw this peer's records now, once: the others stop counting it at their next look, and no longer wait
        on it, group with it or download from it. Call it at the first sign of leaving (peers/join.py's SwarmProgress
        does, before its goodbye record); teardown calls it too. hivemind's own goodbye does not wait for the DHT."""
        if self.rounds is not None:
            self.rounds.withdraw()
        elif self.optimizer is not None and not self._withdrawn:
            self._withdrawn = True
            withdraw_records(self.dht, self.optimizer.tracker, [self.optimizer.state_averager])

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


def _make_rounds(options: HivemindOptions, dht: hivemind.DHT, parameters: list[torch.nn.Parameter]) -> DiLoCoRounds:
    return DiLoCoRounds(
        dht, options.run_id, parameters, inner_steps=options.inner_steps,
        batch_size=options.batch_size, outer_lr=options.outer_lr, outer_momentum=options.outer_momentum,
        matchmaking_time=options.matchmaking_time, averaging_timeout=options.averaging_timeout,
        next_chunk_timeout=options.next_chunk_timeout, compression=COMPRESSION[options.grad_compression](),
        state_compression=COMPRESSION[options.state_compression](), load_state_timeout=options.load_state_timeout,
        aggregation=RobustAggregation.for_swarm(options),
        target_group_size=options.target_group_size, overlap=options.overlap_rounds,
    )


def _advance_schedules(lr_scheduler_configs: list, steps: int, in_optimizer_step: bool) -> None:
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

    def load_state_from_peers(self) -> None:
        """Collective: rank 0 downloads the swarm's outer state, every rank continues from it."""
        if self.rounds is not None:
            self.rounds.load_state_from_peers()
        self._share_outer_state(changed=True, in_optimizer_step=False)

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
            self.rounds = _make_rounds(self.options, self.dht, list(self.lightning_module.parameters()))
            if self.options.coordinator_key is not None:
                self._watch = CoordinatorWatch(self.dht, self.options.run_id, self.options.coordinator_key)
                self._watch.bound(self.rounds.tracker, self.rounds.outer)
            logger.info("Loading the swarm's outer state before the first step")
            self.rounds.load_state_from_peers()
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
        _advance_schedules(self.lr_scheduler_configs, self._round * self.options.inner_steps, in_optimizer_step=False)
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
            reached = wait_for_state(self.rounds.load_state_from_peers, lambda: self.rounds.round, record)
            if reached:
                self.last_rollback = record
            return True, reached
        if self._watch is not None and (clock := self._watch.ran_ahead(self.rounds.round)) is not None:
            logger.warning(f"This peer is at outer round {self.rounds.round}, far beyond the coordinator's count"
                           f" ({clock}): it trained alone while cut off. Loading the swarm's state")
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
            _advance_schedules(self.lr_scheduler_configs, self._round * self.options.inner_steps, in_optimizer_step)
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


class SwarmOptimizer(PatchedOptimizer):
    """A hivemind.Optimizer that keeps non-finite updates out of the swarm.

    A NaN or Inf loss or gradient (a diverging peer, a bad batch, broken hardware) would be averaged into every peer's
    parameters. This peer skips such a step instead, drops its gradients and reloads the swarm's state, since its own
    parameters may be what went wrong. With fp16 the gradient scaler already skips overflowing steps: it is left to it.
    A step whose closure returns None (Lightning: training_step returned None) counts no samples.

    `swarm_seconds` adds up the wall time this peer spent on the swarm rather than on its own batches: the steps that
    end a swarm epoch (waiting for a group, gradient all-reduce, the optimizer step, state averaging) and state
    downloads. The benchmarks report it as the time outside compute, and `missed_rounds`: the averaging rounds this
    peer missed while others were there.

    Its progress tracker skips unusable records, and its averaging rounds are scheduled and timed out as
    PatchedOptimizer says.
    """

    swarm_seconds = 0.0
    missed_rounds = 0
    tracker_class = VettedProgressTracker  # progress entries anyone wrote are untrusted input

    def load_state_from_peers(self, **kwargs) -> None:
        started = time.perf_counter()
        try:
            super().load_state_from_peers(**kwargs)
        finally:
            self.swarm_seconds += time.perf_counter() - started

    def step(self, closure: Optional[Callable[[], torch.Tensor]] = None, batch_size: Optional[int] = None,
             grad_scaler: Optional[hivemind.GradScaler] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            if loss is None:
                return None
        if grad_scaler is None and not self._finite(loss):
            logger.warning("Non-finite loss or gradients: skipping this step and reloading the swarm's state")
            self.zero_grad(set_to_none=True)
            self.load_state_from_peers()
            return loss
        self.missed_round = False
        seconds, epoch, started = self.swarm_seconds, self.local_epoch, time.perf_counter()
        super().step(batch_size=batch_size, grad_scaler=grad_scaler)
        if self.local_epoch != epoch:  # the whole step was the swarm's (a state download inside it included)
            self.swarm_seconds = seconds + time.perf_counter() - started
        if self.missed_round and self.tracker.global_progress.num_peers > 1:
            # It stepped with its own gradients while the others averaged theirs: take the swarm's state rather than
            # drift one epoch apart (where each peer's rounds come when the others are not looking).
            logger.warning("Missed the swarm's averaging round: loading its state instead of drifting")
            self.missed_rounds += 1
            self.load_state_from_peers()
        return loss

    def _finite(self, loss: Optional[torch.Tensor]) -> bool:
        if loss is not None and not torch.isfinite(loss).all():
            return False
        gradients = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        return all(torch.isfinite(g).all() for g in gradients)


def optimizer_recipe(optimizer: torch.optim.Optimizer,
                     scheduler: Optional[torch.optim.lr_scheduler.LRScheduler] = None):
    """What hivemind needs to build a configured torch optimizer and its LR scheduler itself, so that it can offload
    it: (param_groups, optimizer factory, scheduler factory or None). The class, hyperparameters and param groups carry
    over unchanged; the scheduler becomes a SwarmSchedule of a copy of it, stepped once per swarm epoch."""
    if scheduler is not None:
        check_scheduler(scheduler, optimizer)
    optimizer_class = type(optimizer)
    # Each group carries every hyperparameter (torch fills in the defaults), so the groups alone rebuild it.
    param_groups = [dict(group) for group in optimizer.param_groups]

    def make_optimizer(params):
        return optimizer_class(_fused_on_cuda_only(params))

    def make_scheduler(inner: torch.optim.Optimizer) -> SwarmSchedule:
        return SwarmSchedule(scheduler, inner)

    return param_groups, make_optimizer, make_scheduler if scheduler is not None else None


def _fused_on_cuda_only(param_groups: list) -> list:
    """The groups, with `fused` (set by the module's optimizer on CUDA) back to torch's default where their parameters
    are not on CUDA: hivemind offloads the optimizer to copies in host memory (offload_optimizer), and the CPU stays
    on torch's default kernels there, as a CPU peer's optimizer is."""
    return [dict(group, fused=None) if isinstance(group, dict) and group.get("fused")
            and any(param.device.type != "cuda" for param in group["params"]) else group for group in param_groups]


PLATEAU_REFUSED = (
    "HivemindStrategy cannot follow ReduceLROnPlateau: it lowers the learning rate when a metric stops improving, and "
    "each peer measures that metric on its own batches, so the peers would train at different learning rates and a "
    "joining peer could not tell the swarm's. Use a schedule of the step count instead (StepLR, MultiStepLR, "
    "ExponentialLR, CosineAnnealingLR, OneCycleLR, LinearLR, LambdaLR, or a SequentialLR of them): in sync mode it "
    "advances once per swarm epoch, the same on every peer, and in diloco mode once per inner step."
)


def check_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Refuse, before anything starts, an LR scheduler that a swarm cannot follow, saying what to use instead."""
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError(PLATEAU_REFUSED)
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise ValueError(
            f"HivemindStrategy steps torch.optim.lr_scheduler schedulers, not {type(scheduler).__name__}: write the "
            "schedule as a torch.optim.lr_scheduler.LambdaLR of the step count")
    if scheduler.optimizer is not optimizer:
        raise ValueError(f"the LR scheduler {type(scheduler).__name__} schedules another optimizer than the module's")


def schedule_per_inner_step(configs: list) -> list:
    """Lightning's scheduler configs, each stepped after every optimizer step (a diloco peer's inner steps), whatever
    interval and frequency the module asked for: the swarm's catch-up (round x H inner steps) counts in inner steps."""
    per_step = []
    for config in configs:
        if (config.interval, config.frequency) != ("step", 1):
            logger.info(f"The LR scheduler steps once per inner step in diloco mode, not per {config.frequency} "
                        f"{config.interval}(s)")
        per_step.append(dataclasses.replace(config, interval="step", frequency=1))
    return per_step


class _ScheduledGroups:
    """Stands in for the module's optimizer under SwarmSchedule's copy of its scheduler: param groups with the
    optimizer's hyperparameters and no parameters. Only the schedule changes them."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.param_groups = [copy.deepcopy({key: value for key, value in group.items() if key != "params"})
                             for group in optimizer.param_groups]
        self.defaults = dict(optimizer.defaults)  # OneCycleLR and CyclicLR look up momentum or betas here
        # torch warns when a schedule steps before its optimizer ever did (it wraps optimizer.step to know); these
        # groups belong to no optimizer step at all
        self._opt_called = True

    def step(self) -> None:
        """Torch's schedulers look for this method, marked as they mark an optimizer's step when they wrap it."""
        raise RuntimeError("the scheduled groups of a SwarmSchedule hold hyperparameters only: nothing to step")

    step._wrapped_by_lr_sched = True


class SwarmSchedule(torch.optim.lr_scheduler.LRScheduler):
    """The module's LR scheduler as hivemind steps it: once per swarm epoch, on hivemind's own (inner) optimizer.

    It runs a copy of the module's scheduler on stand-in param groups, and after every step writes their
    hyperparameters (the LR, and momentum or betas where a cyclic schedule sets them) into the inner optimizer. The copy
    must not work on the inner optimizer itself: when a peer loads the swarm's state, hivemind overwrites the inner
    optimizer's param groups with another peer's (their learning rates at epoch k) and then steps the scheduler from
    epoch 0 to k, and a recursive schedule (StepLR, MultiStepLR, ExponentialLR, LinearLR, CosineAnnealingLR: each step
    scales the group's current LR) would then apply its k steps a second time. The stand-in groups only ever see the
    schedule, so the LR at swarm epoch k is the schedule's k-th value on every peer, late joiners included: the swarm
    epoch is the scheduler's whole state.
    """

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler, optimizer: torch.optim.Optimizer):
        # No LRScheduler.__init__: it would take an initial step; the copy stands where the module's scheduler stands.
        self.optimizer = optimizer
        self.groups = _ScheduledGroups(scheduler.optimizer)
        self.schedule = _copy_schedule(scheduler, scheduler.optimizer, self.groups, {})
        self.last_epoch = 0  # swarm epochs stepped
        self._step_count = 1  # hivemind steps while _step_count <= its epoch, as for a scheduler that took its first
        self._apply()

    def get_lr(self) -> list[Any]:
        return [group["lr"] for group in self.groups.param_groups]

    def step(self, epoch: Optional[int] = None) -> None:
        if epoch is not None:
            raise ValueError("a SwarmSchedule steps one swarm epoch at a time")
        self.schedule.step()
        self.last_epoch += 1
        self._step_count += 1
        self._apply()

    def _apply(self) -> None:
        for scheduled, group in zip(self.groups.param_groups, self.optimizer.param_groups, strict=True):
            for key, value in scheduled.items():
                if isinstance(group.get(key), torch.Tensor):
                    group[key].fill_(value)  # a tensor hyperparameter (capturable, fused) keeps its identity
                else:
                    group[key] = copy.deepcopy(value)
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """The swarm epochs stepped, the module's scheduler's own state, and the hyperparameters it set."""
        return dict(swarm_epochs=self.last_epoch, schedule=self.schedule.state_dict(),
                    scheduled_groups=copy.deepcopy(self.groups.param_groups))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_epoch = state_dict["swarm_epochs"]
        self._step_count = self.last_epoch + 1
        self.schedule.load_state_dict(copy.deepcopy(state_dict["schedule"]))
        for scheduled, saved in zip(self.groups.param_groups, state_dict["scheduled_groups"], strict=True):
            scheduled.update(copy.deepcopy(saved))
        self._apply()


def _copy_schedule(scheduler: torch.optim.lr_scheduler.LRScheduler, optimizer: Any, target: Any,
                   copies: dict[int, Any]) -> torch.optim.lr_scheduler.LRScheduler:
    """A copy of `scheduler` that schedules `target` instead of `optimizer`, with copies of its sub-schedulers
    (SequentialLR, ChainedScheduler) pointed there too. Its state (counters, base LRs, phases, milestones) is copied;
    what it only calls (LR lambdas, scale and anneal functions) is shared, and a method of the scheduler is bound to
    the copy."""
    duplicate = copy.copy(scheduler)
    copies[id(scheduler)] = duplicate

    def copied(value: Any) -> Any:
        if value is optimizer:
            return target
        if id(value) in copies:
            return copies[id(value)]
        if isinstance(value, torch.optim.lr_scheduler.LRScheduler):
            return _copy_schedule(value, optimizer, target, copies)
        if isinstance(value, types.MethodType) and id(value.__self__) in copies:
            return types.MethodType(value.__func__, copies[id(value.__self__)])
        if isinstance(value, torch.Tensor):
            return value.detach().clone()
        if type(value) in (list, tuple):
            return type(value)(copied(item) for item in value)
        if type(value) is dict:
            return {key: copied(item) for key, item in value.items()}
        return value

    duplicate.__dict__.update({name: copied(value) for name, value in vars(scheduler).items()})
    return duplicate


def copy_into_offloaded(inner: torch.optim.Optimizer, values: list[torch.Tensor]) -> None:
    """Overwrite the parameters of hivemind's offloaded optimizer (its master copy), in param-group order. hivemind
    initialises that optimizer with one zero-gradient step, which applies weight decay to its copy once."""
    with torch.no_grad():
        for param, value in zip((param for group in inner.param_groups for param in group["params"]), values):
            param.copy_(value)


def wrap_optimizer(
    options: HivemindOptions,
    dht: hivemind.DHT,
    optimizer: torch.optim.Optimizer,
    scheduler: Optional[torch.optim.lr_scheduler.LRScheduler] = None,
    private_key: Optional[RSAPrivateKey] = None,
) -> hivemind.Optimizer:
    """Rebuild a configured torch optimizer (and its LR scheduler) inside a hivemind.Optimizer (see
    optimizer_recipe). `private_key` signs this peer's progress records (default: the process's key; two peers in one
    process need one each)."""
    param_groups, make_optimizer, make_scheduler = optimizer_recipe(optimizer, scheduler)
    initial_parameters = [param.detach().clone() for group in param_groups for param in group["params"]]
    with keeping_sigint():
        swarm_optimizer = _swarm_optimizer(options, dht, make_optimizer, param_groups, make_scheduler, private_key)
    _undo_virtual_step(swarm_optimizer, initial_parameters)
    return swarm_optimizer


def _swarm_optimizer(options: HivemindOptions, dht: hivemind.DHT, make_optimizer, param_groups, make_scheduler,
                     private_key: Optional[RSAPrivateKey]) -> SwarmOptimizer:
    return SwarmOptimizer(
        dht=dht,
        run_id=options.run_id,
        target_batch_size=options.target_batch_size,
        batch_size_per_step=options.batch_size,
        optimizer=make_optimizer,
        params=param_groups,
        scheduler=make_scheduler,
        matchmaking_time=options.matchmaking_time,
        averaging_timeout=options.averaging_timeout,
        next_chunk_timeout=options.next_chunk_timeout,
        load_state_timeout=options.load_state_timeout,
        offload_optimizer=options.offload_optimizer,
        reuse_grad_buffers=options.reuse_grad_buffers,
        delay_optimizer_step=options.delay_optimizer_step,
        delay_grad_averaging=options.delay_grad_averaging,
        delay_state_averaging=options.delay_state_averaging,
        average_state_every=options.average_state_every,
        grad_compression=COMPRESSION[options.grad_compression](),
        state_averaging_compression=COMPRESSION[options.state_compression](),
        load_state_compression=COMPRESSION[options.state_compression](),
        client_mode=dht.client_mode,
        # hivemind warns (and may deadlock) when a matchmaking request can outlast the matchmaking window
        averager_opts=dict(request_timeout=min(3.0, options.matchmaking_time / 2), declare_state_period=RECORD_LIFETIME,
                           # groups of at most G for the state averager; PatchedOptimizer gives the gradient
                           # averager the same (hivemind passes averager_opts to the state averager only)
                           **group_matchmaking(options.target_group_size)),
        tracker_opts=dict(metadata_expiration=RECORD_LIFETIME,
                          **(dict(private_key=private_key) if private_key is not None else {})),
        verbose=options.verbose,
        aggregation=RobustAggregation.for_swarm(options),
    )


def _undo_virtual_step(swarm_optimizer: hivemind.Optimizer, initial_parameters: list[torch.Tensor]) -> None:
    """hivemind creates the optimizer's state by running one step with zero gradients. That step counts in Adam's
    bias correction (the first real update comes out ~25% too small) and applies weight decay once. Undo both, so
    that a swarm step is exactly the step the same optimizer would take alone."""
    inner = swarm_optimizer.opt
    copy_into_offloaded(inner, initial_parameters)
    with torch.no_grad():
        for main_param, initial in zip((p for group in swarm_optimizer.param_groups for p in group["params"]),
                                       initial_parameters):
            main_param.copy_(initial)
    for state in inner.state.values():
        if "step" in state:
            state["step"] = torch.zeros_like(state["step"]) if torch.is_tensor(state["step"]) else 0
