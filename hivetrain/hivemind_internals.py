"""Every use HiveTrain makes of hivemind's private API, in one place, written for the hivemind versions in
SUPPORTED_HIVEMIND_VERSIONS.

hivemind's public API does not reach everything a swarm of volunteers needs (hooks into how the optimizer builds its
tracker and averagers, a peer's own progress record, the signed-record formats, its log handler). What follows uses
private names that may change in any release, so importing this module checks the installed version first and
refuses any other: a changed private name would otherwise fail deep inside a training run, or silently do nothing.
No other module touches hivemind's private names (tests/test_hivemind_internals.py checks).
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any, Optional, Sequence

import hivemind
import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.optim.progress_tracker import GlobalTrainingProgress, ProgressTracker
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.multiaddr import Multiaddr

SUPPORTED_HIVEMIND_VERSIONS = ("1.1.12",)


def check_hivemind_version(installed: str) -> None:
    """Refuse a hivemind version the private uses below were not written for."""
    if installed not in SUPPORTED_HIVEMIND_VERSIONS:
        raise ImportError(
            f"HiveTrain relies on hivemind internals (hivetrain/hivemind_internals.py) written for hivemind "
            f"{' or '.join(SUPPORTED_HIVEMIND_VERSIONS)}, but hivemind {installed} is installed. Install a supported "
            f"version: pip install hivemind=={SUPPORTED_HIVEMIND_VERSIONS[-1]}")


check_hivemind_version(hivemind.__version__)


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


# --- logging and networking ---------------------------------------------------------------------------------------

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
    """

    tracker_class: type[ProgressTracker] = HookedProgressTracker
    missed_round = False

    def _make_progress_tracker(self, target_batch_size: int, **kwargs) -> ProgressTracker:
        return self.tracker_class(dht=self.dht, prefix=self.run_id, target_batch_size=target_batch_size,
                                  client_mode=self.client_mode, status_loglevel=self.status_loglevel, start=True,
                                  **kwargs)

    def _make_gradient_averager(self, factory, **kwargs):
        for name in ("request_timeout", "target_group_size", "initial_group_bits"):
            kwargs.setdefault(name, self.state_averager.matchmaking_kwargs[name])
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
