"""Inside hivemind's state downloads: a state is vetted before it is deserialised (its epoch within the coordinator's
bound, its size, its shapes) and taken only once vouched for, by a second holder that serves the same one or by the
run's pinned coordinator; and a sync holder never serves a new epoch with the parameters of the one before.

Two holders vouch for a state by serving it, not by a digest: peers in step hold the same parameters only to float
rounding (fp16 on the wire, each reducing its own part of a round at full precision), so their states are compared
within STATE_AGREEMENT, relative to the tensors' norms, never bit for bit."""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import statistics
import threading
import time
from typing import Any, Callable, Optional

import torch
from hivemind.averaging.control import StepControl
from hivemind.compression import deserialize_torch_tensor
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import combine_from_streaming
from hivemind.utils.timed_storage import ValueWithExpiration

from hivetrain.hivemind_internals.allreduce import SenderClosedAveraging
from hivetrain.hivemind_internals.averaging import (AnswersBeforeLeaving, GroupClosesWhenFull, JoinsStateServer,
                                                    KeepsItsSteps, LastingStateOffer, MembersOnly, WaitsForItsGroup,
                                                    named_for_rpc_as, warn_once_a_minute)

# A downloaded state may be this many times the averager's own tensors (parameters, and Adam's two statistics), plus
# this many bytes; a holder sending more is skipped before its tensors are deserialised.
STATE_BYTES_FACTOR, STATE_BYTES_SLACK = 4, 1 << 16
# Two holders serve the same state when each of its parameter tensors differs between them by at most this much of the
# larger one's norm. Honest peers in step differ by rounding only: an all-reduce's fp16 parts on the wire (relative
# 5e-4 per value, of an update far smaller than the parameters), and the state's own compression (fp16, or 8-bit
# buckets that nearly equal values share).
STATE_AGREEMENT = 1e-3
# At most this many holders that send a state are asked for one download: any two of three honest holders in one
# group agree, and each state is held in memory until one is taken.
MAX_STATE_ASKS = 3
logger = logging.getLogger(__name__)


def state_number(metadata: Any) -> Optional[tuple[int, bool]]:
    """A state's epoch (diloco: round) and whether its holder's round was in flight (it then serves the state that
    round started from), from its metadata; None when it names none."""
    if not isinstance(metadata, dict):
        return None
    number = metadata.get("epoch", metadata.get("round"))
    return (number, metadata.get("in_flight") is True) if isinstance(number, int) else None


def asking_order(priorities: dict[Any, float]) -> list:
    """The holders (the keys of `priorities`, their declared priorities: their epochs) in the order a download asks
    them: the newest first, but a priority counts only up to the median of those declared, and the order is random
    among equals. A priority is its holder's word: counted whole, an attacker declaring the highest one was asked
    first, and two of its keys first in line vouched for each other whatever the swarm held.

    Holders at epoch 0 are left out beside one at a later epoch: a peer that has just started (it declares its
    untrained state until it has loaded one) stood against the one trained holder of a swarm of one, and its second
    joiner took no state (tests/test_diloco.py)."""
    holders = [holder for holder in priorities if priorities[holder] > 0] or list(priorities)
    if not holders:
        return []
    median = statistics.median_low([priorities[holder] for holder in holders])
    return sorted(holders, key=lambda holder: (min(priorities[holder], median), random.random()), reverse=True)


def state_disagreement(first: tuple[Any, list[torch.Tensor]], second: tuple[Any, list[torch.Tensor]],
                       compared: int) -> Optional[str]:
    """Why two downloaded states (metadata, tensors) are not one, in words; None when they are: the same epoch
    (state_number), and their first `compared` tensors each within STATE_AGREEMENT of each other (a non-finite value
    agrees with nothing)."""
    (first_metadata, first_tensors), (second_metadata, second_tensors) = first, second
    number, other = state_number(first_metadata), state_number(second_metadata)
    if number is None or number != other:
        return f"epochs (and rounds in flight) {number} and {other}"
    if min(len(first_tensors), len(second_tensors)) < compared:
        return f"{min(len(first_tensors), len(second_tensors))} tensors, not {compared}"
    for index, (a, b) in enumerate(zip(first_tensors[:compared], second_tensors[:compared])):
        if a.shape != b.shape:
            return f"tensor {index} of shapes {tuple(a.shape)} and {tuple(b.shape)}"
        a, b = a.float(), b.float()
        scale = max(torch.linalg.vector_norm(a), torch.linalg.vector_norm(b))
        difference = torch.linalg.vector_norm(a - b)
        if not difference <= STATE_AGREEMENT * scale:  # NaN: False
            return f"tensor {index} {float(difference / scale):.1e} of its norm apart"
    return None


class BoundedDownloads(KeepsItsSteps, SenderClosedAveraging, MembersOnly, WaitsForItsGroup, AnswersBeforeLeaving,
                       JoinsStateServer, LastingStateOffer, GroupClosesWhenFull):
    """A DecentralizedAverager whose state downloads are vetted before anything is deserialised, in the averager's
    process, and taken only once vouched for. Holders are asked newest first (asking_order), as in hivemind, but one
    declaring a priority beyond `epoch_bound()`, serving a state whose epoch (diloco: round) is beyond it, or sending
    more than STATE_BYTES_FACTOR times this averager's own tensors (plus STATE_BYTES_SLACK) is skipped, with a
    warning, and the next one is asked. hivemind took the first holder's state whole: one declaring the highest
    priority served joiners its epoch of 10^12 (its LR schedule stepped that many times hung the peer), and any size it
    liked. And what a holder serves is its own word: a state is taken once a second holder's agrees with it, or from
    the pinned coordinator (_vouched_state), so a volunteer serving its own parameters at the swarm's epoch is taken
    only where no other holder asked serves a state of that epoch or a later one (docs/security.md)."""

    # The highest epoch a downloaded state may carry (hivetrain.clock.ClockWatcher.bound); None: any.
    epoch_bound: Callable[[], Optional[int]] = staticmethod(lambda: None)
    # The one holder downloads ask (a base58 peer ID), None: any, as above. Set through downloading_only_from, not as
    # a keyword of the load: the callers reach it through loads that take none (DiLoCoRounds.load_state_from_peers,
    # the rollback's wait_for_state).
    only_holder: Optional[str] = None
    # The holder whose state needs no second holder's word (a base58 peer ID: the run's pinned coordinator, set by
    # hivetrain.coordinator_watch), None: none.
    trusted_holder: Optional[str] = None

    @contextlib.contextmanager
    def downloading_only_from(self, holder: Optional[str]):
        """Within the block, downloads ask `holder` alone (a base58 peer ID; None: any holder)."""
        previous, self.only_holder = self.only_holder, holder
        try:
            yield
        finally:
            self.only_holder = previous

    def load_state_from_peers(self, wait: bool = True, timeout: Optional[float] = None):
        future = MPFuture()
        self._outer_pipe.send(("_load_state_from_peers", [], dict(timeout=timeout, future=future,
                                                                  bound=self.epoch_bound(), only=self.only_holder,
                                                                  trusted=self.trusted_holder)))
        return future.result(timeout=timeout) if wait else future

    async def _load_state_from_peers(self, future: MPFuture, timeout: Optional[float] = None,
                                     bound: Optional[int] = None, only: Optional[str] = None,
                                     trusted: Optional[str] = None):
        # as hivemind's: the timeout given bounds the wait for each next part
        timeout = None if timeout is None else (self.next_chunk_timeout or self.request_timeout)
        limit = STATE_BYTES_FACTOR * sum(t.numel() * t.element_size() for t in self._averaged_tensors)
        try:
            found, _ = self.dht.get(f"{self._matchmaking.group_key_manager.prefix}.all_averagers", latest=True) or (
                {}, None)
            holders = {PeerID(peer_id): float(entry.value)
                       for peer_id, entry in (found.items() if isinstance(found, dict) else ())
                       if isinstance(entry, ValueWithExpiration) and isinstance(entry.value, (float, int))}
            asked = {}
            for peer, priority in holders.items():
                if peer == self.peer_id or (only is not None and peer.to_base58() != only):
                    continue
                if bound is not None and priority > bound:
                    _warn_download(peer, f"it declares a state of epoch {priority:g}, beyond {bound}")
                    continue
                asked[peer] = priority
            download = functools.partial(self._download_state, timeout=timeout, bound=bound,
                                         limit=limit + STATE_BYTES_SLACK)
            future.set_result(await self._vouched_state(asked, trusted, download))
        except Exception as e:  # the DHT read failed: no state this time
            logger.warning(f"Could not look for the swarm's state: {type(e).__name__}: {e}")
        finally:
            if not future.done():
                future.set_result(None)

    async def _vouched_state(self, priorities: dict[PeerID, float], trusted: Optional[str],
                             download: Callable) -> Optional[tuple[Any, list[torch.Tensor]]]:
        """The state of the first holder (in asking_order; `priorities`: the holders and their declared priorities)
        whose download a second holder's agrees with (their parameters, within STATE_AGREEMENT: state_disagreement),
        asking at most MAX_STATE_ASKS holders that send one; or, when one holder's state is newer than every other
        one sent (_lone_newest: a swarm's one holder in step, beside holders still behind it), that state unless
        `trusted`'s is newer; else `trusted`'s (the pinned coordinator's, base58; its own state came from holders that
        agreed); else None, warning that none agreed.

        A state behind another is no word against it: a peer that fell behind serves its old epoch until it has loaded
        a new one. Held against the swarm's one holder in step, it left a joiner of test_faults with no state to take
        but the coordinator's, which trails the swarm by a validation, so the joiner was never in step and reloaded at
        every step."""
        holders = asking_order(priorities)
        trusted_peer = next((peer for peer in holders if peer.to_base58() == trusted), None)
        served: list[tuple[PeerID, tuple[Any, list[torch.Tensor]]]] = []
        compared = self._compared_tensors()
        for peer in holders:
            if peer == trusted_peer:
                continue
            if len(served) == MAX_STATE_ASKS:
                break
            state = await download(peer)
            if state is None:
                continue
            for earlier_peer, earlier in served:
                disagreement = state_disagreement(earlier, state, compared)
                if disagreement is None:
                    return earlier
                logger.debug(f"The states of {earlier_peer} and {peer} differ: {disagreement}")
            served.append((peer, state))
        newest = _lone_newest(served)
        if newest is not None and (trusted_peer is None or priorities[newest[0]] >= priorities[trusted_peer]):
            return newest[1]  # nobody else serves a state of its epoch to hold it against
        if trusted_peer is not None:
            state = await download(trusted_peer)
            if state is not None:
                return state
        if len(served) > 1:
            warn_once_a_minute("states disagree", f"Taking no state: no two of the {len(served)} holders asked"
                                                  f" served the same one, and no coordinator's state was at hand")
        return None

    def _compared_tensors(self) -> int:
        """How many of a state's leading tensors two holders must agree on: this averager's own tensors (the
        parameters, which lead every state)."""
        return len(self._averaged_tensors)

    async def _download_state(self, peer: PeerID, timeout: Optional[float], bound: Optional[int],
                              limit: int) -> Optional[tuple[Any, list[torch.Tensor]]]:
        started = time.monotonic()
        try:
            stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
            stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
            metadata, parts, tensors, received = None, [], [], 0
            async for message in aiter_with_timeout(stream, timeout=timeout):
                if message.metadata:
                    metadata = self.serializer.loads(message.metadata)
                    epoch = metadata.get("epoch", metadata.get("round")) if isinstance(metadata, dict) else None
                    if bound is not None and isinstance(epoch, (int, float)) and epoch > bound:
                        _warn_download(peer, f"its state is of epoch {epoch}, beyond {bound}")
                        return None
                received += len(message.tensor_part.buffer)
                if received > limit:
                    _warn_download(peer, f"its state is larger than {limit} bytes")
                    return None
                if message.tensor_part.dtype and parts:  # a new tensor begins: the one before is whole
                    tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                    parts = []
                    if not self._fits(peer, tensors):
                        return None
                parts.append(message.tensor_part)
            if parts:
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
            if not metadata or not self._fits(peer, tensors) or len(tensors) < len(self._averaged_tensors):
                return None
            logger.info(f"Finished downloading state in {time.monotonic() - started:.3f}s from {peer}")
            return metadata, tensors
        except Exception as e:  # a holder that vanished or timed out: the next one
            logger.warning(f"Failed to download state from {peer}: {type(e).__name__}: {e}")
            return None

    def _fits(self, peer: PeerID, tensors: list[torch.Tensor]) -> bool:
        """Whether the state's tensors so far have the shapes of this averager's own, which lead every state (the
        parameters): hivemind copies them in unchecked, and a state of another shape failed each load for good."""
        index = len(tensors) - 1
        if index < len(self._averaged_tensors) and tensors[index].shape != self._averaged_tensors[index].shape:
            _warn_download(peer, f"its tensor {index} is of shape {tuple(tensors[index].shape)}, not"
                                 f" {tuple(self._averaged_tensors[index].shape)}")
            return False
        return True


def _lone_newest(served: list[tuple[PeerID, tuple[Any, list[torch.Tensor]]]],
                 ) -> Optional[tuple[PeerID, tuple[Any, list[torch.Tensor]]]]:
    """The (holder, state) among `served` whose epoch (diloco: round) is beyond every other's; None when two or more
    share the newest epoch. A state naming no epoch is never taken (state_number)."""
    numbered = [(number[0], holder_state) for holder_state in served
                if (number := state_number(holder_state[1][0])) is not None]
    if not numbered:
        return None
    newest = max(epoch for epoch, _ in numbered)
    at_newest = [holder_state for epoch, holder_state in numbered if epoch == newest]
    return at_newest[0] if len(at_newest) == 1 else None


def _warn_download(peer: PeerID, why: str) -> None:
    """At most one warning a minute per holder and reason (each download asks every holder again)."""
    warn_once_a_minute((peer, why.split(",")[0]), f"Skipping the state of {peer}: {why}")


class ServesWholeEpochs(TrainingStateAverager):
    """A TrainingStateAverager that never serves a new epoch with the parameters of the one before. hivemind raises
    `local_epoch` before the epoch's optimizer step runs (in its executor thread) and reads the epoch apart from the
    tensors, so a download in between took epoch N + 1 with the parameters of epoch N, a state this peer never held.
    A rolled-back peer of test_rollback (sync) likely loaded one from its groupmate in CI: its parameters matched
    nothing the groupmate had said it held.

    An epoch's step (blocking: hivemind's default, and ours) runs here as two of hivemind's steps: the new epoch and
    its optimizer step, holding `_whole_epoch`, which the serving thread takes too (a downloader waits for a local
    optimizer step, a fraction of a second); then the state averaging round, without it. Held across the round, it
    kept a holder from serving for as long as its group took to form: a peer back from a cut found no holder that
    answered within its timeout (tests/test_faults.py). Between its optimizer step and the round's end a holder
    serves its own stepped parameters, as hivemind did. A delayed optimizer step (delay_optimizer_step) finishes after
    `step` returns: one epoch stale by hivemind's design, and left as hivemind runs it."""

    def __init__(self, *args, **kwargs):
        self._whole_epoch = threading.Lock()  # before hivemind's __init__, which starts the serving thread
        super().__init__(*args, **kwargs)

    def step(self, increment_epoch: bool = False, optimizer_step: bool = False, delay_optimizer_step: bool = False,
             averaging_round: bool = False, delay_averaging: Optional[bool] = None,
             averaging_control: Optional[StepControl] = None, averaging_opts: Optional[dict] = None, **kwargs):
        averaging = dict(averaging_round=averaging_round, delay_averaging=delay_averaging,
                         averaging_control=averaging_control, averaging_opts=averaging_opts)
        if not (increment_epoch and optimizer_step) or delay_optimizer_step:
            return super().step(increment_epoch=increment_epoch, optimizer_step=optimizer_step,
                                delay_optimizer_step=delay_optimizer_step, **averaging, **kwargs)
        with self._whole_epoch:
            super().step(increment_epoch=True, optimizer_step=True, **kwargs)
        if averaging_round:
            return super().step(**averaging)
        return None

    def get_current_state(self):
        with self._whole_epoch:
            return super().get_current_state()


@named_for_rpc_as(TrainingStateAverager)  # peers download the state and average under hivemind's name
class BoundedStateAverager(ServesWholeEpochs, BoundedDownloads):
    """hivemind's TrainingStateAverager that takes from a downloaded state its parameters, statistics and epoch (up to
    `epoch_bound`), and nothing of its optimizer settings: hivemind loads the sender's param groups (learning rate,
    betas, weight decay) with them, and one peer's lr of 10^6 was every joiner's. This peer's own settings are put
    back before the schedule catches up with the new epoch, which then sets what it schedules (lr, a cyclic
    schedule's momentum) as it does for every peer."""

    _own_settings: Optional[list[dict]] = None  # during a download: this peer's param groups, without their params
    # States taken from the swarm so far. hivemind's load returns nothing whether it took a state or not (no holder
    # answered, or each one's epoch was behind this peer's): a caller compares the count before and after.
    states_taken = 0

    def _compared_tensors(self) -> int:
        return len(self.main_parameters)  # a state's parameters lead it; statistics and extras follow

    def load_state_from_peers(self, **kwargs):
        self._own_settings = [{key: value for key, value in group.items() if key != "params"}
                              for group in self.optimizer.param_groups]
        try:
            return super().load_state_from_peers(**kwargs)
        finally:
            self._own_settings = None

    def _update_scheduler(self):
        # hivemind calls it right after it loaded a downloaded state's settings and epoch
        if self._own_settings is not None:
            for group, own in zip(self.optimizer.param_groups, self._own_settings):
                group.update(own)
            self.states_taken += 1
        super()._update_scheduler()
