"""What a peer shows while it trains and tells the swarm: one line per swarm epoch, a metrics record every few seconds
(hivetrain.telemetry) from a thread of its own, so that a peer blocked in a long swarm round stays in the live view,
a last record that says it left, its events when asked (hivetrain.events), and the stop-at-epoch rule.

A peer on several devices (DiLoCoDDPStrategy) runs this callback on every rank: only global rank zero prints and
publishes, while every rank waits for the peers and applies the stop rule, so that all ranks stop at the same step."""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

import lightning.pytorch as pl
import torch

from hivetrain.digests import tensors_digest, tensors_probe
from hivetrain.events import EventLog
from hivetrain.hand_over import HAND_OVER_TIMEOUT, HAND_OVER_TIMEOUT_INTERRUPTED
from hivetrain.swarm import raise_if_leaving
from hivetrain.telemetry import PUBLISH_EVERY, PeerRecord, finite_or_none, publish_peer_record


class SwarmProgress(pl.Callback):
    def __init__(self, batch_size: int, name: str, hardware: str, client_mode: bool,
                 stop_at_epoch: Optional[int] = None, min_peers: int = 1, publish_every: float = PUBLISH_EVERY,
                 events: EventLog = EventLog(None), speedups: Optional[dict[str, bool]] = None):
        """`batch_size`: the samples this peer trains per local step, on all its devices together. `speedups`: which
        inner-loop speedups are on (hivetrain.speedups), told in the training_started event."""
        self.batch_size, self.stop_at_epoch, self.speedups = batch_size, stop_at_epoch, speedups
        self.name, self.hardware, self.client_mode = name, hardware, client_mode
        self.min_peers, self.publish_every, self.events = min_peers, publish_every, events
        self.epoch = 0
        self.trained = 0  # samples this peer trained
        self.samples = 0  # of which it contributed: the swarm took their gradients (not the strategy's samples_discarded)
        self._epoch_started = time.monotonic()
        # detached loss tensors, read on the host once per line and record (mean_loss), not at every step
        self._losses: list[torch.Tensor] = []  # since the last epoch line
        self._published = (time.monotonic(), 0)  # when, and at how many samples trained
        self._recent_losses: list[torch.Tensor] = []  # since the last record
        self.train_seconds = 0.0  # wall time from the first step on
        self.swarm_seconds = 0.0  # of which in swarm rounds and state downloads (SwarmOptimizer.swarm_seconds)
        self._swarm_seconds_before = 0.0  # spent before the first step: the initial download, not training
        self.missed_rounds = 0  # swarm rounds it missed or could not average
        self.states_served = 0  # diloco: state downloads it answered for joiners (and the coordinator)
        self.wait_seconds = 0.0  # diloco, overlapped rounds: of swarm_seconds, waiting for a round still in flight
        self.communication_seconds = 0.0  # diloco, overlapped rounds: their wall time in the background
        self.rollbacks = 0  # the coordinator's rollbacks this peer took (HivemindStrategy.rollbacks_taken)
        self._train_started: Optional[float] = None
        self._publishing = threading.Lock()  # the training thread's last record and the publishing thread's
        self._stop_publishing = threading.Event()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:  # the strategy's setup has loaded the swarm's state
            self.events("state_loaded", epoch=trainer.strategy.local_epoch,
                        peer_id=trainer.strategy.dht.peer_id.to_base58())
        self._wait_for_peers(trainer)
        self.epoch = trainer.strategy.local_epoch  # after the state download: a late joiner starts where the swarm is
        self._epoch_started = self._train_started = time.monotonic()
        self._swarm_seconds_before = trainer.strategy.swarm_seconds
        if trainer.is_global_zero:
            print(f"Starting at swarm epoch {self.epoch} | params {parameter_digest(pl_module)}", flush=True)
            self.events("training_started", epoch=self.epoch, speedups=self.speedups)
        self._published = (time.monotonic(), 0)
        self._publish(trainer)
        if trainer.is_global_zero:
            threading.Thread(target=self._keep_publishing, args=(trainer,), name="SwarmProgress publisher",
                             daemon=True).start()
        self._maybe_stop(trainer)

    def _keep_publishing(self, trainer: pl.Trainer) -> None:
        while not self._stop_publishing.wait(self.publish_every):
            try:
                self._publish(trainer, periodic=True)
            except Exception as e:  # a record that could not be built or sent now: the next one may be
                print(f"Could not publish this peer's metrics: {type(e).__name__}: {e}", flush=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop_publishing.set()
        if isinstance(exception, KeyboardInterrupt):  # Ctrl-C or SIGTERM: Lightning skips on_train_end then
            self._finish(trainer, hand_over_timeout=HAND_OVER_TIMEOUT_INTERRUPTED)

    def _finish(self, trainer: pl.Trainer, hand_over_timeout: float = HAND_OVER_TIMEOUT) -> None:
        self._stop_publishing.set()
        # The others stop counting this peer in their rounds first: the goodbye below can take a while, and Lightning
        # reaches the strategy's own hooks only after every callback's. Its state offer stays up for now.
        if trainer.is_global_zero:
            trainer.strategy.stop_training_in_swarm()
        # the monitor sees every sample and second this peer contributed, and counts it out at its next look
        self._publish(trainer, wait=True, left=True)
        if trainer.is_global_zero:
            # read after the goodbye is stored: of peers leaving together, the last to store one waits
            epoch, started = trainer.strategy.local_epoch, time.monotonic()
            held = trainer.strategy.hand_over_state(report=lambda line: print(line, flush=True),
                                                    timeout=hand_over_timeout)
            if held is not None:
                self.events("hand_over", epoch=epoch, held=held, seconds=time.monotonic() - started)
            trainer.strategy.leave_swarm()

    def _measure_time(self, trainer: pl.Trainer) -> None:
        if self._train_started is not None and trainer.strategy.tracker is not None:
            self.train_seconds = time.monotonic() - self._train_started
            self.swarm_seconds = trainer.strategy.swarm_seconds - self._swarm_seconds_before
            self.missed_rounds = trainer.strategy.missed_rounds
            if trainer.strategy.rounds is not None:
                self.states_served = trainer.strategy.rounds.outer.states_served
                self.wait_seconds = trainer.strategy.rounds.wait_seconds
                self.communication_seconds = trainer.strategy.rounds.communication_seconds

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        raise_if_leaving()
        speaks = trainer.is_global_zero
        if not self.trained and speaks:
            print(f"First local step done: contributing toward swarm epoch {trainer.strategy.local_epoch}", flush=True)
            self.events("first_step", epoch=trainer.strategy.local_epoch)
        self.trained += self.batch_size
        self.samples = self.trained - trainer.strategy.samples_discarded
        if isinstance(outputs, dict) and "loss" in outputs:  # rank zero's own loss on a peer with several devices
            loss = outputs["loss"].detach()
            self._losses.append(loss)
            if speaks:  # where the publishing thread takes them (the other ranks would only pile them up)
                # no lock: that thread takes the list whole, and a loss that lands in it just after is one value less
                # in one record's mean, where waiting for that thread would stall the training
                self._recent_losses.append(loss)
        epoch = trainer.strategy.local_epoch
        if getattr(trainer.strategy, "rollbacks_taken", 0) != self.rollbacks:
            self.rollbacks = trainer.strategy.rollbacks_taken
            if speaks:
                self._print_rollback_line(trainer, pl_module, trainer.strategy.last_rollback)
            # the jump to the restored state's epoch is no epoch this peer trained
            self.epoch, self._epoch_started, self._losses = epoch, time.monotonic(), []
        elif epoch < self.epoch:  # back from beyond the coordinator's clock (CoordinatorWatch.ran_ahead)
            if speaks:
                self._print_rejoin_line(trainer, pl_module, epoch)
            self.epoch, self._epoch_started, self._losses = epoch, time.monotonic(), []
        if epoch != self.epoch:
            now = time.monotonic()
            if speaks:
                self._print_epoch_line(trainer, pl_module, epoch, seconds=now - self._epoch_started)
            self.epoch, self._epoch_started, self._losses = epoch, now, []
        self._maybe_stop(trainer)

    def _print_epoch_line(self, trainer: pl.Trainer, pl_module: pl.LightningModule, epoch: int, seconds: float) -> None:
        throughput = trainer.strategy.epoch_samples * (epoch - self.epoch) / max(seconds, 1e-6)
        loss = mean_loss(self._losses)
        rounds, diloco = trainer.strategy.rounds, {}
        if rounds is not None:  # its last round and the state downloads it answered so far (benchmarks.scale)
            diloco = dict(group_size=rounds.outer.last_group_size, states_served=rounds.outer.states_served,
                          round_bytes=rounds.outer.last_round_bytes if rounds.outer.last_group_size else None,
                          # overlapped rounds: inner steps taken while the round ran, and the waits for rounds so far
                          overlapped_steps=rounds.last_overlapped_steps, wait_seconds=rounds.wait_seconds,
                          communication_seconds=rounds.communication_seconds,
                          # this peer's inner steps behind its last round (paced in seconds: what its device fit), and
                          # of its rounds whose group was looked for ahead, those where it stood ready when due
                          round_steps=rounds.last_round_steps, rounds_group_ready=rounds.rounds_group_ready)
        digest, probe = self._epoch_parameters(trainer, epoch)
        self.events("epoch", epoch=epoch, samples=self.samples, loss=finite_or_none(loss),
                    swarm_seconds=trainer.strategy.swarm_seconds, probe=probe, **diloco)
        line = (f"swarm epoch {epoch} | {trainer.strategy.num_peers} peer(s) | {throughput:.0f} samples/s"
                f" | this peer: {self.samples} samples, loss {loss:.3f} | params {digest}")
        _say(trainer, line)

    @staticmethod
    def _epoch_parameters(trainer: pl.Trainer, epoch: int) -> tuple[str, list[float]]:
        """The parameters' digest and probe at a new swarm epoch: an overlapped diloco round's thread took both of the
        outer parameters it landed (the training thread need not stop for it; the live parameters then differ by the
        inner steps taken meanwhile), else this peer's live parameters, which after a blocking round are those outer
        ones."""
        rounds = trainer.strategy.rounds
        landed = rounds.landed if rounds is not None else None
        if landed is not None and landed[0] == epoch:
            return landed[1], landed[2]
        return parameter_digest(trainer.lightning_module), parameter_probe(trainer.lightning_module)

    def _print_rejoin_line(self, trainer: pl.Trainer, pl_module: pl.LightningModule, epoch: int) -> None:
        dropped = self.epoch - epoch
        self.events("rejoined", epoch=epoch, dropped=dropped, probe=parameter_probe(pl_module))
        line = (f"Back in step with the swarm at swarm epoch {epoch}: dropped the {dropped} epochs this peer trained"
                f" beyond it alone | params {parameter_digest(pl_module)}")
        _say(trainer, line)

    def _print_rollback_line(self, trainer: pl.Trainer, pl_module: pl.LightningModule, record) -> None:
        epoch = trainer.strategy.local_epoch
        self.events("rollback", sequence=record.sequence, best_epoch=record.epoch, epoch=epoch)
        line = (f"Rolled back to the best validated state (swarm epoch {record.epoch}, top-1 {record.top1:.1%}): the"
                f" coordinator saw {record.reason} | now at swarm epoch {epoch} | params {parameter_digest(pl_module)}")
        _say(trainer, line)

    def _publish(self, trainer: pl.Trainer, wait: bool = False, left: bool = False, periodic: bool = False) -> None:
        if not trainer.is_global_zero:  # the other ranks of a peer on several devices never touch the swarm
            return
        with self._publishing:  # held to the store: the goodbye is the last record, never overtaken by a periodic one
            if periodic and self._stop_publishing.is_set():
                return
            self._publish_locked(trainer, wait, left)

    def _publish_locked(self, trainer: pl.Trainer, wait: bool, left: bool) -> None:
        now, samples, trained = time.monotonic(), self.samples, self.trained
        (since, trained_then), losses = self._published, self._recent_losses
        self._published, self._recent_losses = (now, trained), []
        self._measure_time(trainer)
        rounds, diloco = trainer.strategy.rounds, {}  # diloco: what the dashboard shows of each peer's rounds
        if rounds is not None:
            diloco = dict(inner_steps=rounds.inner_steps_since_round,
                          pseudo_gradient_norm=rounds.outer.last_pseudo_gradient_norm,
                          round_bytes=rounds.outer.last_round_bytes if rounds.outer.last_group_size else None,
                          rounds_averaged=rounds.rounds_averaged, rounds_alone=rounds.rounds_alone,
                          rounds_failed=rounds.rounds_failed)
        record = PeerRecord(
            peer_id=trainer.strategy.dht.peer_id.to_base58(),
            name=self.name,
            hardware=self.hardware,
            client_mode=self.client_mode,
            epoch=trainer.strategy.local_epoch,
            samples_per_second=(trained - trained_then) / max(now - since, 1e-6),  # its speed, whatever became of it
            loss=finite_or_none(mean_loss(losses)) if losses else None,
            samples=samples,
            time=time.time(),
            train_seconds=float(self.train_seconds) if self._train_started is not None else None,
            swarm_seconds=float(self.swarm_seconds) if self._train_started is not None else None,
            left=True if left else None,
            **diloco,
        )
        publish_peer_record(trainer.strategy.dht, trainer.strategy.options.run_id, record, wait=wait)

    def _wait_for_peers(self, trainer: pl.Trainer) -> None:
        """A peer alone takes whole swarm epochs by itself, at full local speed: with --min-peers it waits for others
        to join before its first step. On several devices every rank runs this loop in step with rank zero, which
        counts the peers (announce_and_count_peers is collective there)."""
        if self.min_peers <= 1:
            return  # this peer alone is enough
        waited = 0.0
        while (present := trainer.strategy.announce_and_count_peers()) < self.min_peers:
            if waited % 10 == 0 and trainer.is_global_zero:
                print(f"Waiting for peers: {present} of {self.min_peers} in the swarm", flush=True)
            time.sleep(0.5)
            raise_if_leaving()
            waited += 0.5
        if waited:
            trainer.strategy.catch_up_with_swarm()  # whoever was first may have stepped meanwhile

    def _maybe_stop(self, trainer: pl.Trainer) -> None:
        if self.stop_at_epoch is not None and trainer.strategy.local_epoch >= self.stop_at_epoch:
            trainer.should_stop = True


def mean_loss(losses: list[torch.Tensor]) -> float:
    """The mean of detached step losses, read from the device once for them all (a float() of each step's loss would
    make the GPU wait for the host at every step); nan for none."""
    return float(torch.stack(losses).float().mean()) if losses else float("nan")


def _say(trainer: pl.Trainer, line: str) -> None:
    """A line of the peer's console, above the progress bar when there is one."""
    bar = trainer.progress_bar_callback
    bar.print(line) if bar is not None else print(line, flush=True)


def parameter_digest(module: torch.nn.Module) -> str:
    """A short hash of the module's parameters (hivetrain.digests)."""
    return tensors_digest(module.parameters())


def parameter_probe(module: torch.nn.Module) -> list[float]:
    """A few of the module's parameter values, spread over all of them (hivetrain.digests.tensors_probe)."""
    return tensors_probe(module.parameters())
