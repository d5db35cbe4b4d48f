"""How hivemind runs in our processes: tensor serialisation asks CUDA once, command pipes stay blocking
(both patched at import), and hivemind's log handler, an averager cut short and a direct dial."""

from __future__ import annotations

import functools
import logging
import os
from typing import Optional, Sequence

import hivemind
import hivemind.averaging.averager
import hivemind.dht.dht
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr


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


