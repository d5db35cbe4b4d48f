"""Inside hivemind's all-reduce: answer streams that the sender closes once it holds every part (hivemind's could
lose their last parts), and robust aggregation (the part reducer keeps each sender's copy of a part and hands them to
a hivetrain.robust aggregate, in place of hivemind's weighted mean)."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Optional, Sequence

import torch
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import TensorPartReducer
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import as_aiter, azip


# Seconds a reducer keeps a part's answer stream open after its last answer, for the sender to close it (it does once
# it holds them all: SenderClosedAllReduceRunner); a sender that reads to the end (hivemind's) gets it closed then.
ANSWER_LINGER = 2.0


class ClosesAfterLastPart:
    """A groupmate's stub whose answer stream to rpc_aggregate_part ends, and is closed here, once `parts` averaged
    parts have come (anything else, an error code, passes as hivemind's reads it)."""

    def __init__(self, stub: Any, parts: int):
        self.stub, self.parts = stub, parts

    async def rpc_aggregate_part(self, inputs: AsyncIterator[averaging_pb2.AveragingData]
                                 ) -> AsyncIterator[averaging_pb2.AveragingData]:
        return self._until_last_part(await self.stub.rpc_aggregate_part(inputs))

    async def _until_last_part(self, stream: Any) -> AsyncIterator[averaging_pb2.AveragingData]:
        received = 0
        try:
            async for message in stream:
                yield message
                received += message.code == averaging_pb2.AVERAGED_PART
                if received >= self.parts:
                    return
        finally:
            await stream.aclose()  # closes this end: the reducer's linger ends


class SenderClosedAllReduceRunner(AllReduceRunner):
    """hivemind's AllReduceRunner whose answer streams are closed by the sender, once it holds every part it sent, and
    not by the reducer. hivemind's reducer closed its end after its last answer, and the P2P daemon then reset the
    stream with the answers its sender had yet to read: a sender slow to read (a loaded machine) lost its last parts
    and kept its own values there, apart from its groupmates ("peer ... sent 8 parts, but we expected 13": a diloco
    peer of tests/test_diloco_swarm.py ended its run 1e-4 apart from the others once in six runs)."""

    def _get_peer_stub(self, peer: PeerID) -> Any:
        parts = self.tensor_part_container.num_parts_by_peer[self.ordered_peer_ids.index(peer)]
        return ClosesAfterLastPart(super()._get_peer_stub(peer), parts)

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in super().rpc_aggregate_part(stream, context):
            yield message
        await asyncio.sleep(ANSWER_LINGER)  # cancelled as soon as the sender closes the stream


class PartCopies:
    """Stands in for TensorPartReducer's accumulator, a tensor: hivemind adds each sender's copy of the current part
    into it (add_(part, alpha=weight)) and, once every sender is in, divides it by the summed weight (div_) to get
    the mean. This keeps the copies and their weights instead, and div_ returns their robust aggregate. That is all
    the reducer does with its accumulator, so its own bookkeeping (senders that fail, parts in order) stays hivemind's.
    """

    def __init__(self, shape: torch.Size, aggregation: Any):
        self.shape, self.aggregation = shape, aggregation
        self.parts: list[Optional[torch.Tensor]] = []
        self.weights: list[float] = []

    def add_(self, part: torch.Tensor, alpha: float = 1.0) -> PartCopies:
        # A copy of the wrong shape is kept as absent: it still counts as this sender's part in hivemind's tally.
        self.parts.append(part if isinstance(part, torch.Tensor) and part.shape == self.shape else None)
        self.weights.append(float(alpha))
        return self

    def div_(self, denominator: float) -> torch.Tensor:
        return self.aggregation(self.parts, self.weights, self.shape)


class RobustPartReducer(TensorPartReducer):
    """hivemind's TensorPartReducer whose parts come out as `aggregation(copies, weights, shape)` (a
    hivetrain.robust.RobustAggregation) rather than as the weighted mean of the peers' copies."""

    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int, aggregation: Any):
        self.aggregation = aggregation  # before hivemind's __init__, which prepares the first part
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self) -> None:
        super().reset_accumulators()
        if not self.finished.is_set():
            self.accumulator = PartCopies(self.part_shapes[self.current_part_index], self.aggregation)


class RobustAllReduceRunner(SenderClosedAllReduceRunner):
    """A SenderClosedAllReduceRunner whose reducer (the parts this peer reduces) is a RobustPartReducer. hivemind builds
    its reducer inside __init__ with no hook; this replaces it before any part arrives."""

    def __init__(self, *, aggregation: Any, **kwargs):
        super().__init__(**kwargs)
        replaced = self.tensor_part_reducer
        replaced.finished.set()  # never used: without this its finaliser warns that it received no parts
        self.tensor_part_reducer = RobustPartReducer(replaced.part_shapes, replaced.num_senders, aggregation)


class SenderClosedAveraging:
    """A mixin for a hivemind DecentralizedAverager (put it first among the bases): its all-reduce rounds run a
    SenderClosedAllReduceRunner, or the runner `_make_runner` builds."""

    def _make_runner(self, **kwargs) -> AllReduceRunner:
        return SenderClosedAllReduceRunner(**kwargs)

    # hivemind's DecentralizedAverager._run_allreduce_inplace_, building the runner of _make_runner: hivemind names the
    # runner class inside the method.
    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo,
                                      group_id: Optional[bytes] = None, **kwargs):
        group_id = group_info.group_id if group_id is None else group_id
        runner = self._make_runner(p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors,
                                   group_id=group_id, ordered_peer_ids=group_info.peer_ids, **kwargs)
        if group_id not in self._running_groups:
            raise RuntimeError(f"group {group_id} was not registered in _register_allreduce_group")
        self._running_groups[group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] != AveragingMode.AUX:
            async for tensor, update in azip(as_aiter(*tensors), runner):
                tensor.add_(update, alpha=self._averaging_alpha)
                self.last_updated = get_dht_time()
                self._state_updated.set()
        else:
            async for unexpected_update in runner:
                raise ValueError("aux peers should not receive averaged tensors")


MIN_ROBUST_GROUP_SIZE = 3  # the smallest averaging group in which a robust aggregate can outvote one peer


class RobustAveraging(SenderClosedAveraging):
    """A mixin for a hivemind DecentralizedAverager (put it first among the bases): with `aggregation` (a
    hivetrain.robust.RobustAggregation) its all-reduce rounds reduce their parts robustly; with None, as hivemind
    does. The averager's process forks in its __init__ (start=True), so the aggregation is set before that."""

    aggregation: Any = None

    def __init__(self, *args, aggregation: Any = None, **kwargs):
        self.aggregation = aggregation
        if aggregation is not None:
            # Between two copies no aggregate can tell the honest one: CenteredClip and the trimmed mean are both the
            # mean there. A malicious peer that paired off with one honest peer (groups split when peers reach a round
            # at different times) ruined it, and then outnumbered the honest copies in later groups.
            kwargs["min_group_size"] = max(kwargs.get("min_group_size", 2), MIN_ROBUST_GROUP_SIZE)
        super().__init__(*args, **kwargs)

    def _make_runner(self, **kwargs) -> AllReduceRunner:
        if self.aggregation is None:
            return super()._make_runner(**kwargs)
        return RobustAllReduceRunner(aggregation=self.aggregation, **kwargs)
