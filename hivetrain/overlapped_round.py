"""An overlapped outer round: the round's all-reduce in a background thread while the peer takes the next inner steps,
its result landing on the live parameters as corrections (used by hivetrain.diloco.DiLoCoRounds)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Optional, Sequence

import torch
from hivemind.averaging.control import StepControl

from hivetrain.digests import tensors_digest, tensors_probe
from hivetrain.outer_state import OuterState

logger = logging.getLogger(__name__)


class RoundInFlight:
    """An outer round that runs in a background thread while the peer goes on with its inner steps (an overlapped
    round, as in "Eager updates for overlapped communication and computation in DiLoCo", arXiv 2502.12996).

    The round averages the parameters the peer had when the round was due (a snapshot, taken between two steps), and
    the peer's live parameters take its result as corrections, applied between two inner steps in this order:

    1. eager: once this peer's own outer step is taken (outer parameters p_i, from its own pseudo-gradient and the
       outer momentum), the live parameters move by p_i - snapshot: the next inner steps go on from this peer's own
       outer step, the local stand-in for the swarm's, instead of from its stale inner parameters;
    2. when the group's average p arrives: by p - p_i, which replaces this peer's own outer step with the swarm's.

    After both, the live parameters are p plus the inner steps taken meanwhile: the outer state is the one a blocking
    round reaches, no inner step taken during the communication is lost, and the next round's pseudo-gradient (outer
    minus local parameters) carries those steps to the swarm."""

    def __init__(self, outer: OuterState, parameters: Sequence[torch.Tensor], weight: float,
                 timeout: Optional[float], scheduled: Optional[StepControl] = None):
        self.round, self.weight = outer.round, weight
        self.result: Optional[bool] = None  # as OuterState.outer_step's
        self.seconds = 0.0  # the round's wall time in the background, set when it has finished
        self.inner_steps = 0  # the peer's inner steps while the round was in flight (DiLoCoRounds counts them)
        # of the outer parameters it ended with, hashed and probed here, off the training thread
        self.digest: Optional[str] = None
        self.probe: Optional[list[float]] = None
        self.finished = threading.Event()
        self._corrections: queue.SimpleQueue = queue.SimpleQueue()
        # On the parameters' device, a copy taken in a moment: the thread moves it to the host while training goes on
        snapshot = [p.detach().clone() for p in parameters]
        self._thread = threading.Thread(target=self._run, args=(outer, snapshot, timeout, scheduled), daemon=True,
                                        name=f"outer-round-{self.round}")
        self._thread.start()

    def _run(self, outer: OuterState, snapshot: list[torch.Tensor], timeout: Optional[float],
             scheduled: Optional[StepControl]) -> None:
        started, own = time.perf_counter(), []
        try:
            local = [t.to("cpu", torch.float32) for t in snapshot]
            del snapshot

            def eager() -> None:
                with outer.get_tensors(), torch.no_grad():
                    own.extend(p.clone() for p in outer.outer_parameters)
                self._corrections.put([o - l for o, l in zip(own, local)])

            self.result = outer.outer_step(local, self.weight, timeout, after_own_step=eager, scheduled=scheduled)
            with outer.get_tensors(), torch.no_grad():
                if self.result:  # averaged with others (alone or failed, the outer parameters are this peer's own step)
                    self._corrections.put([p - o for p, o in zip(outer.outer_parameters, own)])
                self.digest = tensors_digest(outer.outer_parameters)
                self.probe = tensors_probe(outer.outer_parameters)
        except Exception as e:  # the averager shut down under the round (the peer is leaving)
            logger.debug(f"Outer round {self.round} broke off: {type(e).__name__}: {e}")
            self.result = None
        finally:
            self.seconds = time.perf_counter() - started
            self.finished.set()

    def apply_corrections(self, parameters: Sequence[torch.Tensor]) -> bool:
        """Add the corrections that have arrived to the live parameters; True when there were any."""
        applied = False
        while True:
            try:
                deltas = self._corrections.get_nowait()
            except queue.Empty:
                return applied
            with torch.no_grad():
                for parameter, delta in zip(parameters, deltas):
                    parameter.add_(delta.to(parameter.device, parameter.dtype))
            applied = True
