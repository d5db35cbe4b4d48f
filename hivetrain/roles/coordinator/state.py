"""The coordinator's own copy of the run's state (parameters, optimizer statistics, epoch), held as an auxiliary
hivemind peer: StateHolder for sync runs, OuterStateHolder for diloco runs (outer parameters, outer momentum, round).

It never trains: it downloads the newest state from the volunteers when asked, and serves what it holds to joiners.
In a run whose trainers nobody can dial, it also leads their averaging rounds (diloco's outer rounds, sync's
gradient all-reduce and state averaging) without a part of its own (hivetrain.roles.coordinator.relay). So the state
survives when every volunteer has left, and `--resume` starts a run from a checkpoint by serving it. It offers its
state only once it holds a real one (downloaded or resumed): a first volunteer must not download the coordinator's
untrained weights in place of its pretrained ones.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional

import hivemind
import torch
from hivemind.optim.state_averager import TrainingStateAverager

from hivetrain.checkpoint import Checkpoint
from hivetrain.config import RunConfig
from hivetrain.hivemind_internals import BoundedStateAverager, catch_up_schedule, named_for_rpc_as
from hivetrain.events import EventLog
from hivetrain.model import create_model
from hivetrain.optimizer import make_optimizer
from hivetrain.outer_state import OuterState, outer_state_prefix, round_matchmaking
from hivetrain.robust import RobustAggregation
from hivetrain.swarm_optimizer import copy_into_offloaded, optimizer_recipe
from hivetrain.swarm_options import COMPRESSION
from hivetrain.swarm import keeping_sigint, withdraw_records
from hivetrain.roles.coordinator.relay import (GradientRelay, RoundRelay, print_flushed, relay_averager_class,
                                              relay_group_size)

logger = logging.getLogger(__name__)


def make_state_holder(dht: hivemind.DHT, config: RunConfig, resume: Optional[Checkpoint] = None,
                      device: torch.device = torch.device("cpu"), events: EventLog = EventLog(None),
                      report: Callable[[str], None] = print_flushed):
    """The run's state holder. `events` and `report` (the coordinator's console): the rounds it relays."""
    if config.swarm.mode == "diloco":
        return OuterStateHolder(dht, config, resume, device=device, events=events, report=report)
    return StateHolder(dht, config, resume, device=device, events=events, report=report)


@named_for_rpc_as(TrainingStateAverager)  # peers download the state under hivemind's name
class CountingStateAverager(BoundedStateAverager):
    """hivemind's state averager, its downloads bounded (BoundedStateAverager), that counts the state downloads it
    answers (the coordinator's `look` events)."""

    def __init__(self, **kwargs):
        self.states_served = 0
        super().__init__(**kwargs)

    def get_current_state(self):
        # hivemind asks the host process for the state once per download it answers (rpc_download_state)
        self.states_served += 1
        return super().get_current_state()


class StateHolder:
    """A sync run's state: parameters, optimizer statistics and epoch, in hivemind's state averager, auxiliary (it
    never averages its own state with the peers'). It relays the peers' gradient and state averaging rounds while
    nobody else can lead them (GradientRelay)."""

    def __init__(self, dht: hivemind.DHT, config: RunConfig, resume: Optional[Checkpoint] = None,
                 device: torch.device = torch.device("cpu"), load_timeout: float = 60.0,
                 events: EventLog = EventLog(None), report: Callable[[str], None] = print_flushed):
        self.config, self.load_timeout = config, load_timeout
        # The architecture only: the state comes from the swarm or the checkpoint.
        self.model = create_model(dataclasses.replace(config.model, pretrained=False), seed=config.seed).to(device)
        if resume is not None:
            self.model.load_state_dict(resume.weights)
        # The same parameter groups, optimizer and schedule as every peer (hivetrain.module), so the state's tensors
        # line up one to one with theirs.
        param_groups, make_inner, make_scheduler = optimizer_recipe(*make_optimizer(self.model, config.optim))
        swarm = config.swarm
        # Auxiliary, with the peers' state matchmaking (hivetrain.swarm_optimizer's), robust when the run is: in a
        # round it relays, it reduces parts and brings none
        averager_class, robust = relay_averager_class(CountingStateAverager, RobustAggregation.for_swarm(swarm))
        with keeping_sigint():
            self.averager = averager_class(
                dht=dht,
                prefix=f"{config.run_id}_state_averager",  # the key hivemind.Optimizer's state averager uses
                optimizer=make_inner,
                params=param_groups,
                scheduler=make_scheduler,
                offload_optimizer=True,
                custom_gradients=True,
                state_compression=COMPRESSION[swarm.state_compression](),
                compression=COMPRESSION[swarm.state_compression](),
                auxiliary=True,
                allow_state_sharing=False,
                start=True,
                **round_matchmaking(swarm.matchmaking_time, swarm.averaging_timeout, swarm.next_chunk_timeout,
                                    swarm.target_group_size),
                **robust,
            )
        if resume is not None:
            self._restore(resume)
        self.relay = GradientRelay.for_run(dht, config, param_groups, lambda: self.averager.epoch_bound(),
                                           events=events, report=report, state_averager=self.averager).start()

    @property
    def epoch(self) -> int:
        return self.averager.local_epoch

    def bound_downloads(self, bound: Callable[[], Optional[int]]) -> None:
        """Refuse a downloaded state whose epoch is beyond `bound()` (hivetrain.clock), with a rate-limited warning."""
        self.averager.epoch_bound = bound

    @property
    def has_state(self) -> bool:
        return self.averager.allow_state_sharing

    @property
    def states_served(self) -> int:
        return self.averager.states_served

    def _restore(self, checkpoint: Checkpoint) -> None:
        inner = self.averager.optimizer
        copy_into_offloaded(inner, self.averager.main_parameters)  # the checkpoint's weights, then its statistics
        if checkpoint.optimizer is not None:
            inner.load_state_dict(checkpoint.optimizer)
        self._offer(checkpoint.epoch)

    def _offer(self, epoch: int) -> None:
        self.averager.local_epoch = epoch
        catch_up_schedule(self.averager)
        self.averager.state_sharing_priority = epoch  # a peer takes it over a lone holder's older state
        self.averager.allow_state_sharing = True

    def load_from_peers(self) -> bool:
        """Download the newest state another peer serves; True when it is from a newer epoch than the one held (an
        epoch-0 state is untrained: not worth holding). hivemind logs and swallows most failures itself (then nothing
        changes); what it raises, the caller sees."""
        before = self.epoch
        self.averager.load_state_from_peers(timeout=self.load_timeout)
        if self.epoch > before:
            self._offer(self.epoch)
            return True
        return False

    def checkpoint(self, metrics: dict) -> Checkpoint:
        return Checkpoint.from_model(self.model, self.config, self.epoch, metrics, self.averager.optimizer,
                                     self.averager.scheduler)

    def roll_back(self, checkpoint: Checkpoint, epoch: int) -> None:
        """Serve `checkpoint`'s state again, numbered swarm epoch `epoch` (ahead of the swarm: hivemind's peers take
        no state older than their own)."""
        self.model.load_state_dict(checkpoint.weights)
        self._restore(dataclasses.replace(checkpoint, epoch=epoch))

    def shutdown(self) -> None:
        self.relay.stop()
        if self.has_state:  # joiners stop asking the coordinator at once
            withdraw_records(self.averager.dht, None, [self.averager])
        self.averager.shutdown()


class OuterStateHolder:
    """A diloco run's state: the outer parameters and outer momentum of round `epoch`, in an OuterState that never
    joins a round. The same contract as StateHolder (epoch, has_state, load_from_peers, model, checkpoint); its
    checkpoints carry the outer optimizer's state (the momentum) as their optimizer state."""

    def __init__(self, dht: hivemind.DHT, config: RunConfig, resume: Optional[Checkpoint] = None,
                 device: torch.device = torch.device("cpu"), load_timeout: float = 60.0,
                 events: EventLog = EventLog(None), report: Callable[[str], None] = print_flushed):
        self.config, self.load_timeout = config, load_timeout
        self.model = create_model(dataclasses.replace(config.model, pretrained=False), seed=config.seed).to(device)
        if resume is not None:
            self.model.load_state_dict(resume.weights)
        swarm = config.swarm
        # Auxiliary: in a round it relays, it reduces parts and brings none (the peers' compression and aggregation)
        aggregation = RobustAggregation.for_swarm(swarm)
        matchmaking = dict(round_matchmaking(swarm.matchmaking_time, swarm.averaging_timeout, swarm.next_chunk_timeout,
                                             swarm.target_group_size), **relay_group_size(aggregation))
        self.outer = OuterState(
            list(self.model.parameters()), dht, outer_state_prefix(config.run_id), swarm.outer_lr, swarm.outer_momentum,
            compression=COMPRESSION[swarm.grad_compression](), state_compression=COMPRESSION[swarm.state_compression](),
            aggregation=aggregation, auxiliary=True, allow_state_sharing=False, **matchmaking,
        )
        if resume is not None:  # the weights went into the outer parameters above; the momentum and round follow
            self._restore(resume, resume.epoch)
        self.relay = RoundRelay(self.outer, f"{config.run_id}_progress", swarm.inner_steps * config.batch_size,
                                swarm.averaging_timeout, events=events, report=report,
                                round_seconds=swarm.round_seconds, matchmaking_time=swarm.matchmaking_time).start()

    def _restore(self, checkpoint: Checkpoint, round_: int) -> None:
        weights = [parameter.detach() for parameter in self.model.parameters()]  # the checkpoint's, loaded before
        state = (checkpoint.optimizer or {}).get("state", {})
        momentum = [state[i]["momentum_buffer"] for i in sorted(state) if "momentum_buffer" in state[i]]
        if not self.outer.set_state(round_, [*weights, *momentum]):
            raise ValueError("the checkpoint's outer optimizer state does not fit this run's model")
        self._offer()

    @property
    def epoch(self) -> int:
        return self.outer.round

    def bound_downloads(self, bound: Callable[[], Optional[int]]) -> None:
        """Refuse a downloaded outer state whose round is beyond `bound()` (hivetrain.clock)."""
        self.outer.epoch_bound = bound

    @property
    def has_state(self) -> bool:
        return self.outer.allow_state_sharing

    @property
    def states_served(self) -> int:
        """State downloads the coordinator has answered."""
        return self.outer.states_served

    def _offer(self) -> None:
        self.outer.state_sharing_priority = self.outer.round
        self.outer.allow_state_sharing = True

    def load_from_peers(self) -> bool:
        """Download the newest outer state; True when it is of a newer round than the one held. A state served
        while its holder's round was in flight is held as the round it is (OuterState.load_from_peers): the holder
        serves it to joiners, who must not take it for the next round's."""
        before = self.epoch
        if self.outer.load_from_peers(timeout=self.load_timeout, join_in_flight=False) and self.epoch > before:
            self.outer.copy_to(list(self.model.parameters()))
            self._offer()
            return True
        return False

    def checkpoint(self, metrics: dict) -> Checkpoint:
        return Checkpoint.from_model(self.model, self.config, self.epoch, metrics, self.outer.outer_optimizer)

    def roll_back(self, checkpoint: Checkpoint, round_: int) -> None:
        """Serve `checkpoint`'s outer state again, numbered round `round_` (ahead of the swarm, so that peers take it
        as the newest)."""
        self.model.load_state_dict(checkpoint.weights)
        self._restore(checkpoint, round_)

    def shutdown(self) -> None:
        self.relay.stop()
        if self.has_state:  # joiners stop asking the coordinator at once
            withdraw_records(self.outer.dht, None, [self.outer])
        self.outer.shutdown()
