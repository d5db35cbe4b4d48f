"""The swarm's optimizer in sync mode: hivemind.Optimizer wrapped for a volunteer swarm (SwarmOptimizer keeps
non-finite updates out), built from a peer's own optimizer and LR schedule (wrap_optimizer), whose schedule it steps on
swarm epochs (SwarmSchedule), and the checks a schedule must pass first."""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
import types
from typing import Any, Callable, Optional

import hivemind
import torch
from hivemind.utils.crypto import RSAPrivateKey

from hivetrain.hivemind_internals import PatchedOptimizer
from hivetrain.record_guard import VettedProgressTracker
from hivetrain.robust import RobustAggregation
from hivetrain.speedups import all_finite
from hivetrain.swarm import RECORD_LIFETIME, group_matchmaking, keeping_sigint
from hivetrain.swarm_options import COMPRESSION, HivemindOptions

logger = logging.getLogger(__name__)


class SwarmOptimizer(PatchedOptimizer):
    """A hivemind.Optimizer that keeps non-finite updates out of the swarm.

    A NaN or Inf loss or gradient (a diverging peer, a bad batch, broken hardware) would be averaged into every peer's
    parameters. This peer skips such a step instead, drops its gradients and reloads the swarm's state, since its own
    parameters may be what went wrong. With fp16 the gradient scaler already skips overflowing steps: it is left to it.
    A step whose closure returns None (Lightning: training_step returned None) counts no samples.

    `samples_discarded` adds up the samples this peer trained whose gradients the swarm never took: non-finite steps,
    steps hivemind dropped because this peer was behind the swarm, and the epochs whose round it missed. A peer's
    published contribution leaves them out (hivetrain.roles.peers.progress).

    `swarm_seconds` adds up the wall time this peer spent on the swarm rather than on its own batches: the steps that
    end a swarm epoch (waiting for a group, gradient all-reduce, the optimizer step, state averaging) and state
    downloads. The benchmarks report it as the time outside compute, and `missed_rounds`: the averaging rounds this
    peer missed while others were there.

    Its progress tracker skips unusable records, and its averaging rounds are scheduled and timed out as
    PatchedOptimizer says.
    """

    swarm_seconds = 0.0
    missed_rounds = 0
    samples_discarded = 0  # trained in steps whose gradients never reached the swarm (see step)
    state_loads = 0  # downloads of the swarm's state begun, hivemind's own included
    tracker_class = VettedProgressTracker  # progress entries anyone wrote are untrusted input

    def load_state_from_peers(self, **kwargs) -> bool:
        """hivemind's download of the swarm's state; whether a holder served one (hivemind's says nothing)."""
        started, taken = time.perf_counter(), self.state_averager.states_taken
        self.state_loads += 1
        # hivemind resets the gradients accumulated toward this epoch's batch as it loads: their samples are lost
        self.samples_discarded += self.tracker.local_progress.samples_accumulated
        try:
            super().load_state_from_peers(**kwargs)
        finally:
            self.swarm_seconds += time.perf_counter() - started
        return self.state_averager.states_taken > taken

    def step_back_to(self, clock: int) -> bool:
        """Take the swarm's state, this peer being beyond the coordinator's `clock` (it trained alone while cut off:
        hivetrain.coordinator_watch); whether a holder served it. hivemind takes no state behind this peer's epoch,
        so the peer steps back to the count first. When no holder served one (the link is barely back, each holder
        timed out), it stands at its own epoch again: at the count, with the parameters it trained alone, it would
        pass for in step with the swarm and never reload."""
        epoch = self.local_epoch
        self._stand_at(clock)
        if self.load_state_from_peers():
            return True
        logger.warning(f"No peer served the swarm's state: this peer stays at swarm epoch {epoch} and tries again")
        self._stand_at(epoch)
        self.tracker.report_local_progress(epoch, 0)  # hivemind dropped the gradients it had accumulated
        return False

    def _stand_at(self, epoch: int) -> None:
        """Put this peer at swarm epoch `epoch`, its LR schedule and the priority of the state it serves with it."""
        self.state_averager.local_epoch = epoch
        if isinstance(self.state_averager.scheduler, SwarmSchedule):
            self.state_averager.scheduler.rewind_to(epoch)
        if not self.client_mode:
            self.state_averager.state_sharing_priority = epoch

    def step(self, closure: Optional[Callable[[], torch.Tensor]] = None, batch_size: Optional[int] = None,
             grad_scaler: Optional[hivemind.GradScaler] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            if loss is None:
                return None
        step_samples = batch_size if batch_size is not None else self.batch_size_per_step
        if grad_scaler is None and not self._finite(loss):
            logger.warning("Non-finite loss or gradients: skipping this step and reloading the swarm's state")
            self.zero_grad(set_to_none=True)
            self.samples_discarded += step_samples  # and the load, those accumulated before
            self.load_state_from_peers()
            return loss
        self.missed_round = False
        seconds, epoch, started = self.swarm_seconds, self.local_epoch, time.perf_counter()
        loads, accumulated = self.state_loads, self.tracker.local_progress.samples_accumulated
        super().step(batch_size=batch_size, grad_scaler=grad_scaler)
        if self.local_epoch != epoch:  # the whole step was the swarm's (a state download inside it included)
            self.swarm_seconds = seconds + time.perf_counter() - started
        if self.state_loads != loads:
            # hivemind found this peer behind the swarm: it dropped the step's gradients, made with out-of-sync
            # parameters, and loaded the state instead (a joiner's first steps, a peer that fell behind); the load
            # counted those accumulated before
            self.samples_discarded += step_samples
        if self.missed_round and self.tracker.global_progress.num_peers > 1:
            # It stepped with its own gradients while the others averaged theirs: take the swarm's state rather than
            # drift one epoch apart (where each peer's rounds come when the others are not looking). The epoch's
            # samples went into its own step only, which the swarm's state replaces when a holder serves one.
            logger.warning("Missed the swarm's averaging round: loading its state instead of drifting")
            self.missed_rounds += 1
            if self.load_state_from_peers():
                self.samples_discarded += accumulated + step_samples  # the epoch's update reset the tracker's count
        return loss

    def _finite(self, loss: Optional[torch.Tensor]) -> bool:
        gradients = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        return all_finite(([] if loss is None else [loss.detach()]) + gradients)


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
        self._start = self.state_dict()

    def rewind_to(self, epoch: int) -> None:
        """Stand at swarm epoch `epoch` again, from the start: hivemind only ever steps a schedule forward, and a peer
        that trained ahead alone (hivetrain.coordinator_watch) goes back to the swarm's epoch."""
        self.load_state_dict(self._start)
        while self.last_epoch < epoch:
            self.step()

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
