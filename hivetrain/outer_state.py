"""The swarm's outer state in DiLoCo rounds: the outer parameters and momentum every peer holds, one round's outer step
on a peer's pseudo-gradient, and their averaging and serving through hivemind's DecentralizedAverager (the robust part
reducer included). hivetrain.diloco decides when a round runs; this module is what a round does."""

from __future__ import annotations

import enum
import logging
import threading
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from hivemind import DHT
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.compression import CompressionBase, NoCompression
from hivemind.utils import get_dht_time

from hivetrain.hivemind_internals import BoundedDownloads, RobustAveraging, wait_unless_left_alone
from hivetrain.record_guard import warn_skipped
from hivetrain.swarm import RECORD_LIFETIME, group_matchmaking, keeping_sigint
from hivetrain.swarm_options import wire_bytes

logger = logging.getLogger(__name__)


# What the coordinator gathers in a round it relays for peers nobody can dial (hivetrain.roles.coordinator.relay):
# no groupmate.
RELAY_GATHER = "relay"

# The weight (samples) of a peer's round while it catches up (OuterState.catching_up): next to a round's hundreds of
# samples, nothing. Not zero: hivemind's mean divides by the group's total weight (NaN for a group of such peers
# alone), and the robust reducers leave zero weights out (such a group would have no copy to reduce).
CATCH_UP_WEIGHT = 1e-3


class GivenUp(enum.Enum):
    """Why a round ended before its group averaged (OuterState.give_up), as the peer's line says it."""

    # The other peers all left while this one's round looked for them, or averaged with them (a swarm of two whose
    # other peer leaves; a peer left out of the last round, whose group finished it and left): hivemind searched on
    # until the averaging timeout (10 s to minutes) before this peer stepped alone.
    LEFT_ALONE = "the other peers left during it, this peer's step stands"
    # The others formed the round's group without this peer (it came to the round a read of the swarm's progress
    # later, on a busy machine) and went on to the next: hivemind searched until the averaging timeout for nobody.
    LEFT_BEHIND = "the swarm averaged it without this peer"


def outer_state_prefix(run_id: str) -> str:
    """The averager's DHT prefix: its groups and the declarations of who serves the outer state."""
    return f"{run_id}_outer"


def round_matchmaking(matchmaking_time: float, averaging_timeout: float, next_chunk_timeout: float,
                      target_group_size: Optional[int]) -> dict[str, Any]:
    """OuterState's matchmaking and all-reduce arguments, the same on every peer of a run and on the coordinator."""
    return dict(
        min_matchmaking_time=matchmaking_time,
        # hivemind warns (and may deadlock) when a matchmaking request can outlast the matchmaking window
        request_timeout=min(3.0, matchmaking_time / 2), next_chunk_timeout=next_chunk_timeout,
        # step(timeout=...) bounds only the search for a group: without this cap an all-reduce whose groupmate died
        # mid-round waited forever (hivemind.Optimizer sets its averagers' cap to the averaging timeout too)
        allreduce_timeout=averaging_timeout, declare_state_period=RECORD_LIFETIME,
        # Groups of at most G (None: everyone due in one group); see group_matchmaking for how they change
        **group_matchmaking(target_group_size),
    )


class OuterState(RobustAveraging, BoundedDownloads):
    """The swarm's shared outer parameters and outer momentum (on the host, float32) and the round they belong to.

    A round takes the outer step (SGD with Nesterov momentum m, learning rate lr, as torch.optim.SGD defines it) on
    this peer's own pseudo-gradient g, then averages the resulting outer parameters with the group, weighted by
    samples, and recovers the averaged pseudo-gradient from them to update the momentum:

        anchor = p - lr m^2 buf;  p_i = anchor - lr (1 + m) g_i;  p = weighted mean of p_i
        mean g = (anchor - p) / (lr (1 + m));  buf = m buf + mean g

    When the peers start from the same (p, buf) this is exactly the outer step on the weighted mean pseudo-gradient,
    as DiLoCo defines it, and only the parameters travel. Averaging parameters rather than pseudo-gradients buys what
    a volunteer swarm needs: peers whose parameters went apart (a round that failed part-way, a peer that stepped
    alone) share them again after their next round together (and a difference in momentum shrinks by m / (1 + m)
    each round), instead of drifting for good. The parameters being close across peers, the all-reduce's own value
    plus delta-to-the-average also rounds to the same float on every peer far more often than a pseudo-gradient's.

    Joiners download (round, parameters + momentum). `outer_optimizer` holds the momentum buffers and the
    hyperparameters in torch's SGD form, which is what checkpoints store."""

    # epoch_bound (BoundedDownloads): the highest round a groupmate or a downloaded state may name; None: any.
    # Whether a round should stop looking for its group (or stop averaging in it), and why (GivenUp), from the swarm's
    # progress records as they are now (hivetrain.diloco.DiLoCoRounds); called with the round and whether it is still
    # looking for its group. None: go on. This peer's own step then stands (wait_unless_left_alone).
    give_up: Callable[[int, bool], Optional["GivenUp"]] = staticmethod(lambda round_, looking: None)

    def __init__(self, parameters: Sequence[torch.Tensor], dht: DHT, prefix: str, outer_lr: float,
                 outer_momentum: float, compression: CompressionBase = NoCompression(),
                 state_compression: CompressionBase = NoCompression(), **kwargs):
        self.outer_parameters = [p.detach().to("cpu", torch.float32, copy=True) for p in parameters]
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self.outer_optimizer = torch.optim.SGD(self.outer_parameters, lr=outer_lr, momentum=outer_momentum,
                                               nesterov=outer_momentum > 0)
        self.momentum = [torch.zeros_like(p) for p in self.outer_parameters] if outer_momentum > 0 else []
        for param, buffer in zip(self.outer_parameters, self.momentum):
            self.outer_optimizer.state[param]["momentum_buffer"] = buffer
        self.round = 0
        self.last_pseudo_gradient_norm: Optional[float] = None  # this peer's own, in its last round
        self.last_group_size = 0  # peers in its last round, itself included
        self.states_served = 0  # state downloads this peer has answered (benchmarks.scale: where joiners go)
        # A round whose group was looked for ahead (schedule_round): whether the group stood ready when it fell due
        self.group_ready_when_due: Optional[bool] = None
        self._round_control: Optional[tuple[int, StepControl]] = None  # the last round's averaging step, by round
        self.compression = compression
        # One round at a time: held for a whole round, the search for its group included (seconds).
        self.round_lock = threading.Lock()
        # Held for moments only: the round number and the state tensors as one (a download, a round's steps). Between
        # a round's local outer step and the end of its all-reduce the parameters are this peer's alone, so a joiner
        # is served the state the round started from (round_start), which the whole group held.
        self._state_lock = threading.Lock()
        self._round_start: Optional[tuple[int, list[torch.Tensor]]] = None
        # This peer holds the state a round in flight started from (a download during it), numbered for the round
        # that follows: its next round averages at CATCH_UP_WEIGHT and takes the group's parameters, rather than
        # pulling the group back a round with its full weight.
        self.catching_up = False
        # The averaged tensors are the outer parameters themselves (hivemind moves them to shared memory in place).
        with keeping_sigint():
            super().__init__(averaged_tensors=self.outer_parameters, dht=dht, prefix=prefix, compression=compression,
                             state_compression=state_compression, start=True, **kwargs)

    def _state_tensors(self) -> list[torch.Tensor]:
        return [*self.outer_parameters, *self.momentum]

    def advertise_round(self) -> None:
        """Joiners ask the peers with the newest round first. A peer in client mode serves no state (nobody can dial
        it), and hivemind refuses it a priority: such a peer exited after its first round."""
        if not self.client_mode:
            self.state_sharing_priority = self.round

    def get_current_state(self):
        # hivemind asks the host process for the state once per download it answers (rpc_download_state). It must
        # not wait for a round in flight: that round's group may be waiting for this very joiner (a second peer that
        # loads the first one's state before its first round), and an overlapped peer has a round in flight nearly
        # all the time. Copies: the state may change while it is sent.
        with self._state_lock:
            self.states_served += 1
            if self._round_start is not None:
                round_, start = self._round_start
                return dict(round=round_, in_flight=True), [t.clone() for t in (*start, *self.momentum)], None
            with self.get_tensors():
                return dict(round=self.round), [t.clone() for t in self._state_tensors()], None

    def set_state(self, round_: int, tensors: Sequence[torch.Tensor]) -> bool:
        """Take a state (from a peer or a checkpoint) after checking it: a round number, one tensor of the right shape
        per parameter and momentum buffer, finite values. Anything else is skipped with a warning; True when taken."""
        mine = self._state_tensors()
        if (not isinstance(round_, int) or round_ < 0 or len(tensors) != len(mine)
                or any(not isinstance(t, torch.Tensor) or t.shape != m.shape for t, m in zip(tensors, mine))
                or not all(torch.isfinite(t).all() for t in tensors)):
            logger.warning("Skipping a malformed outer state")
            return False
        with self._state_lock, self.get_tensors(), torch.no_grad():
            for m, t in zip(mine, tensors):
                m.copy_(t)
            self.round, self.catching_up = round_, False
        return True

    def load_from_peers(self, timeout: Optional[float] = None, join_in_flight: bool = True) -> bool:
        """Take the newest outer state another peer serves; True when one was loaded.

        A holder whose round is in flight serves the state that round started from (round r), which its whole group
        held. A trainer (`join_in_flight`) takes it as round r + 1, the round the swarm is finishing, and catches up
        at its next round (catching_up): in a robust run, whose groups hold peers of one round only, a state of
        round r would leave it a round behind the swarm for good, each reload again landing mid-round. The
        coordinator's holder, which trains nothing and serves what it holds, takes it as round r.

        Args:
            timeout: seconds to wait for each next part of the state.
            join_in_flight: take a state served mid-round as the round that follows it, catching up.
        """
        try:
            loaded = self.load_state_from_peers(timeout=timeout)
        except Exception as e:  # a peer that vanished mid-download, a timeout
            logger.warning(f"Could not download the swarm's outer state: {type(e).__name__}: {e}")
            return False
        if loaded is None:
            return False
        metadata, tensors = loaded  # its round within the bound (BoundedDownloads)
        metadata = metadata if isinstance(metadata, dict) else {}
        round_, in_flight = metadata.get("round"), metadata.get("in_flight") is True and join_in_flight
        if not self.set_state(round_ + 1 if in_flight and isinstance(round_, int) else round_, tensors):
            return False
        if in_flight:
            self.catching_up = True
            logger.info(f"Loaded the state of outer round {round_}, whose round was in flight: this peer takes round"
                        f" {self.round} with the swarm, catching up (its own steps weigh nothing in it)")
        return True

    @property
    def groups_by_round(self) -> bool:
        """Whether a round's group holds peers of that round only (robust runs), rather than every round looking
        for its group under one key.

        A robust aggregate outvotes an attacker only while the honest copies agree. A groupmate from an earlier round
        is honest but far from the others: in a group of three with it, the attacker's copy moved the result that far
        (tests/test_attacks.py saw two honest peers end at 29% top-1). Robust runs group only peers of the same round
        (its last two bits in the group key); a peer that fell behind finds no group, takes its own step, and loads
        the swarm's state at its next look."""
        return self.aggregation is not None

    def look_in_groups_of(self, round_: int) -> None:
        """The group key for round `round_`'s search (groups_by_round; the coordinator's relay too)."""
        if self.groups_by_round:
            self.set_group_bits(f"{round_ % 4:02b}")

    def group_found(self, round_: int) -> bool:
        """Whether round `round_`'s search for its group is over (its all-reduce running, or the round done): only then
        may the next round's group be looked for, since hivemind's averager looks for one group at a time, and a
        search beside another could pair this peer's two rounds with one groupmate's round."""
        current = self._round_control
        return (current is not None and current[0] == round_
                and current[1].stage in (AveragingStage.RUNNING_ALLREDUCE, AveragingStage.FINISHED))

    def schedule_round(self, at: float, timeout: float) -> StepControl:
        """Look for this round's group from now on, to be formed at `at`; its all-reduce then waits for outer_step to
        trigger it with this peer's outer parameters (hivemind's scheduled step): the group is found while the peer
        still trains, and matchmaking leaves the round's critical path.

        Args:
            at: when the group forms (a Unix time, as hivemind's DHT time); every groupmate aims at the same.
            timeout: seconds after `at` to go on looking for a group.

        Returns:
            hivemind's StepControl, to hand to outer_step (or to cancel when the round changes under it).
        """
        self.look_in_groups_of(self.round)
        return self.step(gather=self.round, scheduled_time=at, timeout=max(0.0, at - get_dht_time()) + timeout,
                         require_trigger=True, wait=False)

    def outer_step(self, local_parameters: Sequence[torch.Tensor], weight: float, timeout: Optional[float],
                   after_own_step: Optional[Callable[[], None]] = None,
                   scheduled: Optional[StepControl] = None) -> Optional[bool]:
        """One round: the outer step on this peer's pseudo-gradient (outer minus local parameters), then, unless
        `timeout` is None (alone), the outer parameters averaged with the group, weighted by `weight`. Returns True
        when averaged with others, False when alone, None when averaging failed (the peer keeps its own step).

        Args:
            local_parameters: this peer's parameters after its inner steps (any device and dtype).
            weight: the samples behind them.
            timeout: seconds to find a group; None: no others, the step is this peer's alone.
            after_own_step: called once the outer parameters hold this peer's own outer step, before the group
                averages them (an overlapped round applies that step to the inner steps at once: RoundInFlight).
            scheduled: this round's group, looked for ahead (schedule_round at this round): its all-reduce is
                triggered here. Cancelled when `timeout` is None.
        """
        with self.round_lock:
            return self._outer_step(local_parameters, weight, timeout, after_own_step, scheduled)

    def _outer_step(self, local_parameters: Sequence[torch.Tensor], weight: float, timeout: Optional[float],
                    after_own_step: Optional[Callable[[], None]], scheduled: Optional[StepControl]) -> Optional[bool]:
        lr, m = self.outer_lr, self.outer_momentum
        with self._state_lock, self.get_tensors(), torch.no_grad():
            start, squares = [], 0.0  # the outer parameters the round starts from: served while it is in flight
            for index, (outer, local) in enumerate(zip(self.outer_parameters, local_parameters)):
                start.append(outer.clone())
                pseudo_gradient = outer - local.detach().to("cpu", torch.float32)
                squares += float(torch.linalg.vector_norm(pseudo_gradient)) ** 2
                if m:
                    outer.sub_(self.momentum[index], alpha=lr * m * m)  # the anchor
                outer.sub_(pseudo_gradient, alpha=lr * (1 + m))
            started_round, self.round = self.round, self.round + 1
            self._round_start = (started_round, start)
            catching_up, self.catching_up = self.catching_up, False
        if catching_up and timeout is not None:
            weight = CATCH_UP_WEIGHT
        self.last_pseudo_gradient_norm, self.last_group_size = squares ** 0.5, 1
        averaged, self.group_ready_when_due = False, None
        try:
            gathered = self._average_own_step(started_round, weight, timeout, after_own_step, scheduled)
        except BaseException:
            with self._state_lock:
                self._round_start = None  # the round broke off: downloads get what the parameters hold now
            raise
        ended_round = started_round + 1
        if gathered is not None:
            # the coordinator, when it relayed the round, brought no parameters: no groupmate
            trainers = {peer: value for peer, value in gathered.items() if value != RELAY_GATHER}
            # Groupmates that came from a later round bring this peer's round number up with their parameters; a
            # round beyond the coordinator's clock (hivetrain.clock) is a groupmate's word against it, skipped.
            ended_round = max([started_round, *self._usable_rounds(trainers.values())]) + 1
            averaged, self.last_group_size = len(trainers) > 1, len(trainers)
        with self._state_lock, self.get_tensors(), torch.no_grad():  # the momentum takes the averaged pseudo-gradient
            for outer, anchor, buffer in zip(self.outer_parameters, start, self.momentum):
                anchor.sub_(buffer, alpha=lr * m * m)  # the anchor, as the outer step took it
                buffer.mul_(m).add_(anchor.sub_(outer), alpha=1 / (lr * (1 + m)))
            self.round, self._round_start = ended_round, None
        if timeout is not None and gathered is None:
            return None
        return averaged

    def _average_own_step(self, started_round: int, weight: float, timeout: Optional[float],
                          after_own_step: Optional[Callable[[], None]],
                          scheduled: Optional[StepControl]) -> Optional[dict[Any, Any]]:
        """The round's all-reduce of the outer parameters (holding this peer's own step) with its group: what each
        groupmate gathered, or None (alone, no group, a groupmate that vanished)."""
        if after_own_step is not None:
            after_own_step()
        if timeout is None:
            if scheduled is not None:
                scheduled.cancel()
            return None
        try:
            if scheduled is not None:
                self.group_ready_when_due = scheduled.stage == AveragingStage.AWAITING_TRIGGER
                scheduled.weight = weight
                scheduled.allow_allreduce()
                control = scheduled
            else:
                self.look_in_groups_of(started_round)
                # Retries until `timeout`: the others notice that the round is due at their next look at the swarm's
                # progress, and a slow peer after its current step.
                control = self.step(weight=weight, timeout=timeout, gather=started_round, wait=False)
            self._round_control = (started_round, control)
            ended: Optional[GivenUp] = None

            def given_up() -> bool:
                nonlocal ended
                ended = self.give_up(started_round, control.stage == AveragingStage.LOOKING_FOR_GROUP)
                return ended is not None

            if wait_unless_left_alone(control, given_up, timeout):
                logger.info(f"Outer round {started_round}: {ended.value}")
                if ended is GivenUp.LEFT_BEHIND:
                    return None  # no group: the caller counts a failed round, this peer's own step stands
                return {self.peer_id: started_round}  # a group of one: this peer's own step
            return control.result()
        except Exception as e:  # no group, a groupmate that vanished mid-round
            logger.debug(f"Outer round {started_round} failed: {type(e).__name__}: {e}")
            return None

    def _usable_rounds(self, gathered: Iterable[Any]) -> list[int]:
        bound, usable = self.epoch_bound(), []
        for round_ in gathered:
            if not isinstance(round_, int) or isinstance(round_, bool) or round_ < 0:
                continue
            if bound is not None and round_ > bound:
                warn_skipped(f"{self.prefix} groupmates", "ahead of the coordinator's clock",
                             f"round {round_}, beyond {bound}")
                continue
            usable.append(round_)
        return usable

    @property
    def last_round_bytes(self) -> int:
        """What this peer sent in its last round, estimated: hivemind's butterfly all-reduce in a group of n sends
        (n - 1) / n of the averaged tensors to the other reducers, and as much again of averaged results back."""
        n = self.last_group_size
        return int(2 * (n - 1) / n * self._tensor_bytes) if n else 0

    def relayed_bytes(self, trainers: int) -> int:
        """What a relayed round of `trainers` peers moves through the auxiliary peer that reduces every part of it
        (hivetrain.roles.coordinator.relay), estimated: each trainer's tensors in, and the average back out to each."""
        return 2 * trainers * self._tensor_bytes

    @property
    def _tensor_bytes(self) -> int:
        """The averaged tensors' size on the wire under this averager's compression."""
        return wire_bytes(sum(p.numel() for p in self.outer_parameters), self.compression)

    def copy_to(self, local_parameters: Sequence[torch.Tensor]) -> None:
        with self.get_tensors(), torch.no_grad():
            for local, outer in zip(local_parameters, self.outer_parameters):
                local.copy_(outer)
