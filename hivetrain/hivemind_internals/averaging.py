"""Inside hivemind's averagers: our subclasses answering under hivemind's RPC names (robust aggregation mixed in from
allreduce), steps held while they run, a state server joined on shutdown, RPCs answered only for a private run's
members, a shutdown that first sends groupmates their parts, and a round that ends once its peers are gone. State
downloads are in downloads.py."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from typing import Any, AsyncIterator, Callable, Optional

import hivemind
import hivemind.averaging.averager
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import achain, as_aiter

from hivetrain.hivemind_internals.allreduce import RobustAveraging, SenderClosedAveraging


STATE_SERVER_JOIN_TIMEOUT = 10.0  # seconds an averager's shutdown waits for the state download it is answering
ADMITTED_FOR = 10.0  # seconds an averager answers a caller its DHT process admitted without asking again
GROUP_REGISTRATION_POLL = 0.005  # seconds between two looks for the group of a groupmate's part (WaitsForItsGroup)
ANSWERS_SHARE = 0.5  # of an averager's shutdown_timeout, spent at most sending groupmates their parts
ANSWERS_POLL = 0.01  # seconds between two looks whether those are sent
logger = logging.getLogger(__name__)


def named_for_rpc_as(averager_class: type) -> Callable[[type], type]:
    """A class decorator: the decorated subclass of `averager_class` takes its name. hivemind names a servicer's RPC
    protocols after its class ("TrainingStateAverager.rpc_download_state"), so a subclass under a name of its own
    serves nobody, and no peer can download the state from it or average with it."""

    def rename(subclass: type) -> type:
        subclass.__name__ = averager_class.__name__
        return subclass

    return rename


class KeepsItsSteps(hivemind.averaging.averager.DecentralizedAverager):
    """A DecentralizedAverager whose averaging steps are held by the averager while they run. hivemind's averager
    process runs each command as an asyncio task and keeps no reference to it, and asyncio holds tasks weakly. A step
    that waits for its trigger (a group looked for ahead) is reachable only through its MPFutures, which hivemind's
    backend holds weakly too: Python's garbage collector destroyed it (GeneratorExit in `_step`, "pipe to origin
    process was broken"), its trigger then went nowhere, and the round never ran. It struck once the next command's
    task took the last reference's place (a step for the next round, looked for ahead), whenever the collector ran
    before the trigger: 3 of 6 runs of test_averaging's late-trigger test under a running suite, each with the
    GeneratorExit, and none in the runs without."""

    async def _step(self, **kwargs):
        held, task = self.__dict__.setdefault("_steps_held", set()), asyncio.current_task()
        held.add(task)
        try:
            return await super()._step(**kwargs)
        finally:
            held.discard(task)


class JoinsStateServer(hivemind.averaging.averager.DecentralizedAverager):
    """A DecentralizedAverager whose shutdown waits (STATE_SERVER_JOIN_TIMEOUT at most) for the thread that answers
    its state downloads in this process. hivemind only tells that thread to stop: one still copying and serializing a
    state for a downloader, in torch's C++ code, when the process exits aborts it ("terminate called without an
    active exception", exit code -6, after a peer had saved its weights)."""

    def shutdown(self) -> None:
        answering = self.is_alive()  # hivemind signals the thread only then
        super().shutdown()
        if not answering:
            return
        for thread in threading.enumerate():
            if (getattr(thread, "_target", None) is hivemind.averaging.averager._background_thread_fetch_current_state
                    and thread._args[1] is self._outer_pipe):
                thread.join(STATE_SERVER_JOIN_TIMEOUT)


class LastingStateOffer(hivemind.averaging.averager.DecentralizedAverager):
    """A DecentralizedAverager whose offer to share its state (`<prefix>.all_averagers`) is renewed at half its
    lifetime (declare_state_period), as hivemind's ProgressTracker renews a progress record. hivemind renews the offer
    only when it expires: a joiner reading while the renewal still travelled found no holder, and with the coordinator
    the only holder left, tests/test_faults.py saw a new volunteer start from scratch at epoch 0 beside the
    coordinator's epoch-85 state. A holder gone without a word still lapses within declare_state_period."""

    async def _declare_for_download_periodically(self):
        download_key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
        sharing_was_allowed = self.allow_state_sharing
        while True:
            now = get_dht_time()
            expiration_time = now + self.declare_state_period
            if self.allow_state_sharing or sharing_was_allowed:
                # as hivemind's: stored even when just switched off (None), to overwrite the offer before
                asyncio.create_task(asyncio.wait_for(
                    self.dht.store(download_key, subkey=self.peer_id.to_bytes(),
                                   value=self.state_sharing_priority if self.allow_state_sharing else None,
                                   expiration_time=expiration_time, return_future=True),
                    timeout=self.declare_state_period))
                sharing_was_allowed = self.allow_state_sharing
            self._state_updated.clear()  # renewed at half the lifetime, or at once when the offer changes
            try:
                await asyncio.wait_for(self._state_updated.wait(),
                                       timeout=max(0.0, now + self.declare_state_period / 2 - get_dht_time()))
            except asyncio.TimeoutError:
                pass


class GroupClosesWhenFull(hivemind.averaging.averager.DecentralizedAverager):
    """A DecentralizedAverager told, before each round, how many peers train in the swarm now (the progress records):
    its leader starts the all-reduce as soon as that many have joined its group, or the run's group size G if smaller.
    Without a target group size, hivemind's leader waits out the whole matchmaking window (min_matchmaking_time, and
    longer for a group looked for ahead) however soon every peer of the swarm has joined, and a round takes at least
    that long (`python scripts/demo.py` here: the peers' time in rounds was 21-23% in 3 runs, 11-20% in 4 with
    this). A peer the records do not show yet (a joiner) may find a group already full, and misses that round."""

    def expect_peers(self, peers: int) -> None:
        """Close this averager's next groups once they hold `peers` peers (at least 2), or G: the pipe carries the
        commands in order, so a step sent after this sees it."""
        limit = self.matchmaking_kwargs.get("target_group_size")
        size = max(2, peers) if limit is None else min(limit, max(2, peers))
        if size != getattr(self, "_expected_group_size", None):
            self._expected_group_size = size
            self._outer_pipe.send(("_expect_group_of", [], dict(size=size)))

    async def _expect_group_of(self, size: int) -> None:
        self._matchmaking.target_group_size = size  # hivemind's leader reads it at each join request


class WaitsForItsGroup(hivemind.averaging.averager.DecentralizedAverager):
    """A DecentralizedAverager that holds a groupmate's part of an all-reduce until this peer has registered that
    part's group (its own trigger, for a round looked for ahead), rather than turning it away.

    hivemind answers a part for a group it has not registered yet after waiting for `_pending_groups_registered`,
    which every step clears when it starts looking and any group's registration sets. A group looked for ahead while
    the previous round's all-reduce still runs (an overlapped peer) is cleared early, then set by that previous
    round: a groupmate that triggers the new round first had its part refused (BAD_GROUP_ID), and its all-reduce and
    this peer's each waited out `next_chunk_timeout` for the missing half ("received 50.0% of input tensors"), every
    round (`scripts/demo.py --round-seconds 1`: rounds of 5 s, and peers whose parameters differed by 8.6e-3)."""

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.AveragingData]:
        request = await anext(stream)
        # as long as the sender waits for this peer's answer; a group never registered is refused after it
        deadline = time.monotonic() + (self.next_chunk_timeout or self.request_timeout)
        while request.group_id not in self._running_groups and time.monotonic() < deadline:
            await asyncio.sleep(GROUP_REGISTRATION_POLL)
        async for message in super().rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield message


class AnswersBeforeLeaving(hivemind.averaging.averager.DecentralizedAverager):
    """A DecentralizedAverager whose shutdown first sends its groupmates the rest of the parts it averaged for them
    (ANSWERS_SHARE of its shutdown_timeout at most). A peer's all-reduce ends once it holds its own averaged parts,
    while it may still be sending the others theirs; a client-mode groupmate (a NAT'd volunteer) gets all its parts
    only after it has sent every one. hivemind shut the averager down under them: such a groupmate of a peer that left
    right after its round kept its own values for 87-93% of its tensors, and its round counted as averaged
    (tests/test_averaging.py). Answers for a group still running here are not waited for: that round is cancelled."""

    def _answering_groups(self) -> dict[object, bytes]:
        """The group of each part being answered now: in the averager's process, where RPCs run."""
        return self.__dict__.setdefault("_answering", {})

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.AveragingData]:
        request = await anext(stream)
        answering, answer = self._answering_groups(), object()
        answering[answer] = request.group_id
        try:
            async for message in super().rpc_aggregate_part(achain(as_aiter(request), stream), context):
                yield message
        finally:
            answering.pop(answer, None)

    async def _shutdown(self, timeout: Optional[float]) -> None:
        started = time.monotonic()
        deadline = started + ANSWERS_SHARE * (timeout if timeout is not None else self.shutdown_timeout)
        while (any(group not in self._running_groups for group in self._answering_groups().values())
               and time.monotonic() < deadline):
            await asyncio.sleep(ANSWERS_POLL)
        await super()._shutdown(None if timeout is None else max(0.0, timeout - (time.monotonic() - started)))


class MembersOnly(hivemind.averaging.averager.DecentralizedAverager):
    """A DecentralizedAverager whose RPCs (join requests, parts of an all-reduce, state downloads) answer only the
    callers that `caller_check` admits: a coroutine function run in the DHT's process as
    `caller_check(peer_id_bytes, dht, node)` (hivetrain.membership.is_member, set by hivetrain.membership.check_callers
    in a private run before the averagers fork). hivemind answers anyone who reaches the port. A caller turned away
    gets hivemind's refusal (a join: not looking for a group; a part: a protocol violation; a download: no state), and
    one warning a minute. With no check set (a public run), everyone is answered, as in hivemind."""

    caller_check: Optional[Callable[..., Any]] = None

    async def _admits(self, context: P2PContext) -> bool:
        if self.caller_check is None:
            return True
        admitted = self.__dict__.setdefault("_admitted_until", {})  # in the averager's process, where RPCs run
        now, caller = time.monotonic(), context.remote_id
        if admitted.get(caller, 0.0) > now:
            return True
        try:
            allowed = await self.dht.run_coroutine(functools.partial(self.caller_check, caller.to_bytes()),
                                                   return_future=True)
        except Exception as e:  # the DHT is shutting down: nobody
            logger.debug(f"Could not check caller {caller}: {type(e).__name__}: {e}")
            allowed = False
        if allowed:
            if len(admitted) >= 4096:
                admitted.clear()
            admitted[caller] = now + ADMITTED_FOR
        else:
            _warn_refused(caller)
        return allowed

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest, context: P2PContext
                             ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if not await self._admits(context):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.AveragingData]:
        if not await self._admits(context):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_aggregate_part(stream, context):
            yield message

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest, context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if not await self._admits(context):
            return  # as hivemind's refusal: the downloader asks the next holder
        async for message in super().rpc_download_state(request, context):
            yield message


def _warn_refused(caller: PeerID) -> None:
    warn_once_a_minute((caller, "refused"), f"Refusing averaging requests from {caller}: no member record of this"
                                            f" private run vouches for it")


def _missing_mixins(averager_class: type) -> tuple[type, ...]:
    """The mixins every averager of ours has (KeepsItsSteps, SenderClosedAveraging, MembersOnly, WaitsForItsGroup,
    AnswersBeforeLeaving, JoinsStateServer, GroupClosesWhenFull) that `averager_class` lacks."""
    return tuple(mixin for mixin in (KeepsItsSteps, SenderClosedAveraging, MembersOnly, WaitsForItsGroup,
                                     AnswersBeforeLeaving, JoinsStateServer, GroupClosesWhenFull)
                 if not issubclass(averager_class, mixin))


def _subclass_under_its_name(maker: str, averager_class: type, mixins: tuple[type, ...]) -> type:
    """`averager_class` with `mixins` first among its bases, answering under its name (RPC); `maker` names the
    function that made it (its qualified name)."""
    return named_for_rpc_as(averager_class)(type(averager_class.__name__, (*mixins, averager_class), {
        "__module__": __name__, "__qualname__": f"{maker}.{averager_class.__name__}"}))


@functools.cache
def robust_averager_class(averager_class: type) -> type:
    """`averager_class` (a DecentralizedAverager subclass) with RobustAveraging and the mixins every averager of ours
    has mixed in, under its name (RPC)."""
    mixins = tuple(mixin for mixin in _missing_mixins(averager_class) if not issubclass(RobustAveraging, mixin))
    return _subclass_under_its_name("robust_averager_class", averager_class, (RobustAveraging, *mixins))


@functools.cache
def members_only_class(averager_class: type) -> type:
    """`averager_class` (a DecentralizedAverager subclass) with the mixins every averager of ours has
    (_missing_mixins) mixed in, under its name (RPC); itself when it has them."""
    mixins = _missing_mixins(averager_class)
    return _subclass_under_its_name("members_only_class", averager_class, mixins) if mixins else averager_class


def warn_once_a_minute(key: Any, message: str) -> None:
    """Warn `message` unless a warning under `key` (a peer and a reason) went out less than a minute ago. At most
    MAX_WARNED_KEYS keys are remembered: a flood of peer IDs costs a repeated line, not memory."""
    now = time.monotonic()
    if now >= _warned_until.get(key, 0.0):
        if len(_warned_until) >= MAX_WARNED_KEYS:
            _warned_until.clear()
        _warned_until[key] = now + 60.0
        logger.warning(message)


MAX_WARNED_KEYS = 4096
_warned_until: dict = {}  # (peer, reason) -> time.monotonic() before which it is not warned about again


# --- rounds whose peers are gone ------------------------------------------------------------------------------------

LEFT_ALONE_CHECK_S = 1.0  # how often a round looks whether it should end early (the other peers gone)
# ... and how often while it looks for its group: a peer that comes to a round whose group formed without it must
# notice within a fraction of the others' matchmaking time (1 s in the demo). The others start their next round as they
# land this one; a peer that gave up a look later than that searched for the next round after its group formed too,
# and so on: the attacks smoke's attacker, last by 0.4 s to its first round, averaged none of 3 in one run of 10 at a
# look every second; at a quarter second while looking, 2.7 of 3 on average in 10 runs, and at least 1. Looking this
# often, a read that missed the others' records comes often too: DiLoCoRounds counts a round alone only after a
# second of such reads.
LOOKING_CHECK_S = 0.25


def wait_unless_left_alone(control: StepControl, left_alone: Callable[[], bool], timeout: Optional[float]) -> bool:
    """Wait for the averaging round `control` (at most `timeout` seconds; None: until it is done), asking
    `left_alone()` every LOOKING_CHECK_S while the round looks for its group and every LEFT_ALONE_CHECK_S after; cancel
    the round once it says so. Whether it did.

    The other peers may leave while this one's round looks for them: the round was scheduled ahead, or began before
    their withdrawn records reached this peer's tracker, or they averaged it without this peer and left. hivemind then
    looked for the group until the averaging timeout (10 s to minutes) before this peer stepped alone."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while deadline is None or time.monotonic() < deadline:
        looking = control.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP)
        try:
            control.result(timeout=LOOKING_CHECK_S if looking else LEFT_ALONE_CHECK_S)
        except BaseException:  # not done yet; or failed, cancelled: the caller's own wait says so
            pass
        if control.done():
            return False
        if left_alone():
            control.cancel()
            return True
    return False
