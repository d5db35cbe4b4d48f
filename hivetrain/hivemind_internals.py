"""Every use HiveTrain makes of hivemind's private API, in one place, written for the hivemind versions in
SUPPORTED_HIVEMIND_VERSIONS.

hivemind's public API does not reach everything a swarm of volunteers needs (hooks into how the optimizer builds its
tracker and averagers, a peer's own progress record, the signed-record formats, its log handler, the all-reduce's part
reducer). What follows uses
private names that may change in any release, so importing this module checks the installed version first and
refuses any other: a changed private name would otherwise fail deep inside a training run, or silently do nothing.
No other module touches hivemind's private names (tests/test_hivemind_internals.py checks).
"""

from __future__ import annotations

import functools
import logging
import os
import random
import re
import threading
import time
from typing import Any, Callable, Optional, Sequence

import hivemind
import torch
from google.protobuf.message import DecodeError

SUPPORTED_HIVEMIND_VERSIONS = ("1.1.12",)
# A downloaded state may be this many times the averager's own tensors (parameters, and Adam's two statistics), plus
# this many bytes; a holder sending more is skipped before its tensors are deserialised.
STATE_BYTES_FACTOR, STATE_BYTES_SLACK = 4, 1 << 16
STATE_SERVER_JOIN_TIMEOUT = 10.0  # seconds an averager's shutdown waits for the state download it is answering
logger = logging.getLogger(__name__)


def check_hivemind_version(installed: str) -> None:
    """Refuse a hivemind version the private uses below were not written for."""
    if installed not in SUPPORTED_HIVEMIND_VERSIONS:
        raise ImportError(
            f"HiveTrain relies on hivemind internals (hivetrain/hivemind_internals.py) written for hivemind "
            f"{' or '.join(SUPPORTED_HIVEMIND_VERSIONS)}, but hivemind {installed} is installed. Install a supported "
            f"version: pip install hivemind=={SUPPORTED_HIVEMIND_VERSIONS[-1]}")


# before the imports below: on another version, any of them may be gone, and the message above says why
check_hivemind_version(hivemind.__version__)

import hivemind.averaging.averager  # noqa: E402
import hivemind.dht.dht  # noqa: E402
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode  # noqa: E402
from hivemind.averaging.group_info import GroupInfo  # noqa: E402
from hivemind.averaging.partition import TensorPartReducer  # noqa: E402
from hivemind.dht.crypto import RSASignatureValidator  # noqa: E402
from hivemind.optim.grad_averager import GradientAverager  # noqa: E402
from hivemind.optim.progress_tracker import GlobalTrainingProgress, ProgressTracker  # noqa: E402
from hivemind.optim.state_averager import TrainingStateAverager  # noqa: E402
from hivemind.p2p import P2P, PeerID  # noqa: E402
from hivemind.proto import averaging_pb2, crypto_pb2  # noqa: E402
from hivemind.utils import get_dht_time  # noqa: E402
from hivemind.compression import deserialize_torch_tensor  # noqa: E402
from hivemind.utils.asyncio import aiter_with_timeout, as_aiter, azip  # noqa: E402
from hivemind.utils.mpfuture import MPFuture  # noqa: E402
from hivemind.utils.streaming import combine_from_streaming  # noqa: E402
from hivemind.utils.timed_storage import ValueWithExpiration  # noqa: E402
from hivemind.utils.crypto import RSAPrivateKey  # noqa: E402
from hivemind.utils.multiaddr import Multiaddr  # noqa: E402


# --- serialisation ------------------------------------------------------------------------------------------------

@functools.cache
def _cuda_is_available() -> bool:
    return torch.cuda.is_available()


def _check_pinned_once(tensor: torch.Tensor) -> bool:
    try:
        return _cuda_is_available() and tensor.is_pinned()
    except RuntimeError:  # as hivemind's own: torch could not initialise CUDA
        return False


def ask_cuda_availability_once() -> None:
    """hivemind asks torch.cuda.is_available() for every tensor part it serialises (tensor_descr._safe_check_pinned).
    Lightning sets PYTORCH_NVML_BASED_CUDA_CHECK=1 (so that forked processes may still use CUDA), which makes each of
    those calls try to load NVML anew: on a machine without a GPU that costs the averager processes a few percent of a
    core. Availability does not change while a process runs: this replaces hivemind's check with one that asks once.
    Call it before the DHT and averagers fork."""
    hivemind.utils.tensor_descr._safe_check_pinned = _check_pinned_once


# --- command pipes -----------------------------------------------------------------------------------------------

class _LoopKeepingPipesBlocking:
    """An event loop whose add_reader leaves the file descriptor blocking. hivemind's DHT and averager processes take
    their commands from a multiprocessing pipe the loop watches (loop.add_reader), and uvloop makes a watched
    descriptor non-blocking. multiprocessing sends a message over 16 KiB in two writes, so a recv() that runs between
    them (a store of large records on a loaded machine) reads half a message and fails with EAGAIN, the next recv()
    reads the rest as garbage, and the DHT process dies with EOFError: every later call on the DHT then hangs or fails.
    The loop only needs readiness from the descriptor; recv() after poll() waits the microseconds to the second write.
    """

    def __init__(self, loop):
        self._loop = loop

    def __getattr__(self, name: str):
        return getattr(self._loop, name)

    def add_reader(self, fd, callback, *args) -> None:
        self._loop.add_reader(fd, callback, *args)
        os.set_blocking(fd, True)


def _switch_to_uvloop_keeping_pipes_blocking():
    return _LoopKeepingPipesBlocking(hivemind.utils.switch_to_uvloop())


# DHT.run and DecentralizedAverager.run call switch_to_uvloop by the name they imported: replacing it there applies to
# every DHT and averager this process (or a process it forks) starts, hivemind's own classes included.
hivemind.dht.dht.switch_to_uvloop = _switch_to_uvloop_keeping_pipes_blocking
hivemind.averaging.averager.switch_to_uvloop = _switch_to_uvloop_keeping_pipes_blocking


# --- progress records ---------------------------------------------------------------------------------------------

class HookedProgressTracker(ProgressTracker):
    """hivemind's ProgressTracker with a public hook on every read of the swarm's progress records. hivemind parses
    them in its private _parse_swarm_progress_data (in the constructor too), with no other place to look at them
    first."""

    def before_parsing_progress(self, metadata: Any) -> Any:
        """The progress records as read from the DHT, before hivemind parses them: a subclass may inspect or filter
        them (and must return what hivemind is to parse)."""
        return metadata

    def _parse_swarm_progress_data(self, metadata) -> GlobalTrainingProgress:
        return super()._parse_swarm_progress_data(self.before_parsing_progress(metadata))


def progress_subkey(tracker: ProgressTracker) -> bytes:
    """The subkey under which this peer's tracker stores its progress record (its signing key's public part): the only
    way to overwrite that record, e.g. to withdraw it on leaving. hivemind keeps it private."""
    return tracker._local_public_key


def announce_and_count_peers(dht: hivemind.DHT, tracker: ProgressTracker) -> int:
    """Publish this peer's progress with no samples yet and read everyone's into its tracker; return the training
    peers counted. hivemind publishes a peer's progress only once it has samples and has no public call for either
    half: its tracker builds the record (_get_local_progress) and parses the swarm's (_parse_swarm_progress_data)
    privately."""
    own = tracker._get_local_progress(tracker.local_progress.epoch, samples_accumulated=0)
    dht.store(tracker.training_progress_key, subkey=progress_subkey(tracker), value=own.dict(),
              expiration_time=get_dht_time() + tracker.metadata_expiration)
    found = dht.get(tracker.training_progress_key, latest=True)
    with tracker.lock_global_progress:
        tracker.global_progress = tracker._parse_swarm_progress_data(found.value if found is not None else None)
    tracker.global_state_updated.set()  # its fetcher plans its next look from this progress
    return tracker.global_progress.num_peers


# --- signed records -----------------------------------------------------------------------------------------------

SIGNED_SUBKEY_RE: re.Pattern = RSASignatureValidator._PUBLIC_KEY_RE  # b"[owner:<public key>]", a signed subkey
SIGNATURE_RE: re.Pattern = RSASignatureValidator._SIGNATURE_RE  # the signature appended to a signed value


def signature_checker() -> RSASignatureValidator:
    """An RSASignatureValidator that verifies signatures and can sign nothing. Its validate checks a signature with
    class attributes only; made without __init__ (which would load or generate a private key) it holds no key."""
    return RSASignatureValidator.__new__(RSASignatureValidator)


def rsa_key_from_der(data: bytes) -> RSAPrivateKey:
    """hivemind's RSAPrivateKey holding a DER-encoded key. hivemind loads keys only from its own pickled form or
    generates them; its key object wraps a `cryptography` key in a private attribute."""
    from cryptography.hazmat.primitives import serialization

    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key._private_key = serialization.load_der_private_key(data, password=None)
    return key


def identity_key(path: str) -> RSAPrivateKey:
    """The RSA key of the peer identity file at `path` (hivemind's P2P keeps a libp2p PrivateKey protobuf there; the
    peer ID is its public part's hash), created as P2P would when the file does not exist yet."""
    if not os.path.exists(path):
        P2P.generate_identity(path)
    with open(path, "rb") as file:
        data = file.read()
    try:
        stored = crypto_pb2.PrivateKey.FromString(data)
        if stored.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError
        return rsa_key_from_der(stored.data)
    except (DecodeError, ValueError):
        raise ValueError(f"{path} is not a peer identity (a libp2p RSA private key, as hivemind writes them)") from None


def write_identity(key: RSAPrivateKey, path: str) -> None:
    """Keep `key` as a peer identity file at `path`, in the form identity_key reads and hivemind's P2P starts with."""
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400), "wb") as file:
        file.write(crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=key.to_bytes()).SerializeToString())


def sign_records_with(key: RSAPrivateKey) -> None:
    """Make `key` this process's record-signing key: hivemind's RSAPrivateKey.process_wide(), which every
    RSASignatureValidator() made without a key signs with (the run record, rollback records). hivemind generates that
    key afresh in each process and offers no way to set it. Call it before the first validator is made."""
    current = RSAPrivateKey._process_wide_key
    if current is not None and current.to_bytes() != key.to_bytes():
        raise RuntimeError("this process already signs records with another key")
    RSAPrivateKey._process_wide_key = key


# --- logging and networking ---------------------------------------------------------------------------------------

def is_averager_cut_short(error: BaseException) -> bool:
    """The error of finalising an averager whose __init__ was interrupted before it set its private _parent_pid."""
    return isinstance(error, AttributeError) and "_parent_pid" in str(error)


def hivemind_log_handler() -> Optional[logging.Handler]:
    """The handler hivemind installs on its loggers (None when hivemind's logging is off): the only place to filter
    what its own records print."""
    from hivemind.utils import logging as hivemind_logging

    return hivemind_logging._default_handler


async def dial(p2p: P2P, peer_id: PeerID, maddrs: Sequence[Multiaddr]) -> None:
    """Connect p2p's libp2p host to peer_id at exactly these addresses. hivemind's P2P opens connections only inside
    its own calls; the daemon client that dials is private."""
    await p2p._client.connect(peer_id, list(maddrs))


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
    - `missed_round` tells whether the last step's gradient averaging round failed while one was begun.
    - Its state averager is a BoundedStateAverager: a downloaded state's epoch is bounded, its optimizer settings
      are not taken.
    """

    tracker_class: type[ProgressTracker] = HookedProgressTracker
    missed_round = False

    def __init__(self, *args, aggregation: Any = None, **kwargs):
        self.aggregation = aggregation  # before hivemind's __init__, which builds (and starts) the averagers
        super().__init__(*args, **kwargs)

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
            # tests/test_hivemind_internals.py (coordinator/state.py uses the same key)
            dht=self.dht, prefix="{}_state_averager".format(self.run_id), min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout, shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer, custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel, next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode, auxiliary=self.auxiliary, start=True, **kwargs)

    def _make_gradient_averager(self, factory, **kwargs):
        for name in ("request_timeout", "target_group_size", "initial_group_bits"):
            kwargs.setdefault(name, self.state_averager.matchmaking_kwargs[name])
        if self.aggregation is not None:
            factory = functools.partial(robust_averager_class(factory or GradientAverager),
                                        aggregation=self.aggregation)
        return super()._make_gradient_averager(factory, **kwargs)

    # A peer alone steps every few batches. hivemind pre-schedules an averaging round before each of those steps and
    # cancels it at the step, but the cancelled round keeps the averager's matchmaking busy, and the real rounds queue
    # behind it ("Another look_for_group is already in progress") and time out: peers that started alone then missed
    # round after round together. Alone, there is nothing to schedule.
    def _maybe_schedule_gradient_averaging(self) -> None:
        if self.tracker.global_progress.num_peers > 1:
            super()._maybe_schedule_gradient_averaging()

    def _maybe_schedule_state_averaging(self) -> None:
        if self.tracker.global_progress.num_peers > 1:
            super()._maybe_schedule_state_averaging()

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control) -> None:
        super()._average_gradients_and_load_into_optimizer(maybe_step_control)
        if maybe_step_control is None:  # no round was begun (no other peers): nothing was missed
            self.missed_round = False
            return
        try:
            self.missed_round = not maybe_step_control.done() or maybe_step_control.exception() is not None
        except BaseException:  # a cancelled round
            self.missed_round = True


# --- robust aggregation inside the all-reduce ---------------------------------------------------------------------

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


class RobustAllReduceRunner(AllReduceRunner):
    """hivemind's AllReduceRunner whose reducer (the parts this peer reduces) is a RobustPartReducer. hivemind builds
    its reducer inside __init__ with no hook; this replaces it before any part arrives."""

    def __init__(self, *, aggregation: Any, **kwargs):
        super().__init__(**kwargs)
        replaced = self.tensor_part_reducer
        replaced.finished.set()  # never used: without this its finaliser warns that it received no parts
        self.tensor_part_reducer = RobustPartReducer(replaced.part_shapes, replaced.num_senders, aggregation)


MIN_ROBUST_GROUP_SIZE = 3  # the smallest averaging group in which a robust aggregate can outvote one peer


class RobustAveraging:
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

    # hivemind's DecentralizedAverager._run_allreduce_inplace_, building a RobustAllReduceRunner: hivemind names the
    # runner class inside the method.
    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo,
                                      group_id: Optional[bytes] = None, **kwargs):
        if self.aggregation is None:
            return await super()._run_allreduce_inplace_(tensors, group_info, group_id=group_id, **kwargs)
        group_id = group_info.group_id if group_id is None else group_id
        runner = RobustAllReduceRunner(
            aggregation=self.aggregation, p2p=self._p2p, servicer_type=type(self), prefix=self.prefix,
            tensors=tensors, group_id=group_id, ordered_peer_ids=group_info.peer_ids, **kwargs)
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


def named_for_rpc_as(averager_class: type) -> Callable[[type], type]:
    """A class decorator: the decorated subclass of `averager_class` takes its name. hivemind names a servicer's RPC
    protocols after its class ("TrainingStateAverager.rpc_download_state"), so a subclass under a name of its own
    serves nobody, and no peer can download the state from it or average with it."""

    def rename(subclass: type) -> type:
        subclass.__name__ = averager_class.__name__
        return subclass

    return rename


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


@functools.cache
def robust_averager_class(averager_class: type) -> type:
    """`averager_class` (a DecentralizedAverager subclass) with RobustAveraging mixed in, under its name (RPC)."""
    joins = () if issubclass(averager_class, JoinsStateServer) else (JoinsStateServer,)
    return named_for_rpc_as(averager_class)(type(
        f"Robust{averager_class.__name__}", (RobustAveraging, *joins, averager_class),
        {"__module__": __name__, "__qualname__": f"robust_averager_class.{averager_class.__name__}"}))


class BoundedDownloads(JoinsStateServer):
    """A DecentralizedAverager whose state downloads are vetted before anything is deserialised, in the averager's
    process: holders are asked from the highest declared priority down as in hivemind, but one declaring a priority
    beyond `epoch_bound()`, serving a state whose epoch (diloco: round) is beyond it, or sending more than
    STATE_BYTES_FACTOR times this averager's own tensors (plus STATE_BYTES_SLACK) is skipped, with a warning, and the
    next one is asked. hivemind took the first holder's state whole: one declaring the highest priority served
    joiners its epoch of 10^12 (its LR schedule stepped that many times hung the peer), and any size it liked."""

    # The highest epoch a downloaded state may carry (hivetrain.clock.ClockWatcher.bound); None: any.
    epoch_bound: Callable[[], Optional[int]] = staticmethod(lambda: None)

    def load_state_from_peers(self, wait: bool = True, timeout: Optional[float] = None):
        future = MPFuture()
        self._outer_pipe.send(("_load_state_from_peers", [], dict(timeout=timeout, future=future,
                                                                  bound=self.epoch_bound())))
        return future.result(timeout=timeout) if wait else future

    async def _load_state_from_peers(self, future: MPFuture, timeout: Optional[float] = None,
                                     bound: Optional[int] = None):
        # as hivemind's: the timeout given bounds the wait for each next part
        timeout = None if timeout is None else (self.next_chunk_timeout or self.request_timeout)
        limit = STATE_BYTES_FACTOR * sum(t.numel() * t.element_size() for t in self._averaged_tensors)
        try:
            found, _ = self.dht.get(f"{self._matchmaking.group_key_manager.prefix}.all_averagers", latest=True) or (
                {}, None)
            holders = {PeerID(peer_id): (float(entry.value), random.random())  # at random among equals
                       for peer_id, entry in (found.items() if isinstance(found, dict) else ())
                       if isinstance(entry, ValueWithExpiration) and isinstance(entry.value, (float, int))}
            for peer in sorted(holders, key=holders.get, reverse=True):
                if peer == self.peer_id:
                    continue
                if bound is not None and holders[peer][0] > bound:
                    _warn_download(peer, f"it declares a state of epoch {holders[peer][0]:g}, beyond {bound}")
                    continue
                loaded = await self._download_state(peer, timeout, bound, limit + STATE_BYTES_SLACK)
                if loaded is not None:
                    future.set_result(loaded)
                    return
        except Exception as e:  # the DHT read failed: no state this time
            logger.warning(f"Could not look for the swarm's state: {type(e).__name__}: {e}")
        finally:
            if not future.done():
                future.set_result(None)

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


def _warn_download(peer: PeerID, why: str) -> None:
    """At most one warning a minute per holder and reason (each download asks every holder again)."""
    now, key = time.monotonic(), (peer, why.split(",")[0])
    if now >= _download_warned.get(key, 0.0):
        _download_warned[key] = now + 60.0
        logger.warning(f"Skipping the state of {peer}: {why}")


_download_warned: dict = {}


@named_for_rpc_as(TrainingStateAverager)  # peers download the state and average under hivemind's name
class BoundedStateAverager(TrainingStateAverager, BoundedDownloads):
    """hivemind's TrainingStateAverager that takes from a downloaded state its parameters, statistics and epoch (up to
    `epoch_bound`), and nothing of its optimizer settings: hivemind loads the sender's param groups (learning rate,
    betas, weight decay) with them, and one peer's lr of 10^6 was every joiner's. This peer's own settings are put
    back before the schedule catches up with the new epoch, which then sets what it schedules (lr, a cyclic
    schedule's momentum) as it does for every peer."""

    _own_settings: Optional[list[dict]] = None  # during a download: this peer's param groups, without their params

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
        super()._update_scheduler()
