"""The coordinator's watch over how good the shared model is (Validator): every few swarm epochs it downloads the
newest state, evaluates it, keeps the best checkpoint and, when asked, rolls the swarm back from a collapse. It writes
to the metrics store and to `loggers` as the swarm monitor does (hivetrain.roles.coordinator.swarm_monitor), and never
stops on what a peer did or failed to do."""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Callable, Optional, Sequence

from torch.utils.data import DataLoader

from hivetrain.checkpoint import CheckpointError, CheckpointStore
from hivetrain.evaluate import evaluate
from hivetrain.metrics_store import CheckpointRow, MetricsWriter, RollbackRow, ValidationRow
from hivetrain.rollback import ROUNDS_AHEAD, RollbackRecord

logger = logging.getLogger(__name__)


class Validator:
    """Every `every` swarm epochs: download the newest state, evaluate it, and save a checkpoint on a new best top-1.

    `holder` is the coordinator's StateHolder (anything with load_from_peers(), epoch, has_state, model,
    checkpoint(metrics) and roll_back(checkpoint, epoch)); `swarm_epoch` tells where the swarm is; `loggers` are
    SummaryWriter-like (add_scalar, add_text).

    With `rollback_drop` (top-1 points), a validation whose top-1 is more than that below the best, or whose loss is
    not finite, rolls the swarm back: the holder serves the best checkpoint's state again, numbered ROUNDS_AHEAD
    swarm epochs ahead of the swarm (peers take no state older than theirs, and the epochs keep counting forward), and
    `publish_rollback` gets the signed record's content for the peers.

    When `last_peers_epoch()` says no peer trains any more, and the last ones left at that epoch, their state is
    downloaded and validated whatever `every` says: they keep it up for this coordinator before they leave
    (hivetrain.hand_over), and a run's last state is then held, served to the next joiner, and validated. Their epoch
    may be beyond the swarm's count: a rollback's state is served ahead of it.
    """

    def __init__(self, holder, loader: DataLoader, writer: MetricsWriter, checkpoints: CheckpointStore,
                 swarm_epoch: Callable[[], int], every: int = 1, device: str = "cpu", loggers: Sequence = (),
                 attempts: int = 3, backoff: float = 1.0, report: Callable[[str], None] = print,
                 rollback_drop: Optional[float] = None,
                 publish_rollback: Callable[[RollbackRecord], None] = lambda record: None,
                 last_peers_epoch: Callable[[], Optional[int]] = lambda: None):
        self.holder, self.loader, self.writer, self.checkpoints = holder, loader, writer, checkpoints
        self.swarm_epoch, self.every, self.device, self.loggers = swarm_epoch, every, device, loggers
        self.attempts, self.backoff, self.report = attempts, backoff, report
        self.rollback_drop, self.publish_rollback = rollback_drop, publish_rollback
        self.last_peers_epoch = last_peers_epoch
        self.validated: Optional[int] = None  # the epoch of the last validation
        # A restarted coordinator keeps beating the best it saved before, not merely its first validation.
        self.best_top1: Optional[float] = max((e.top1 for e in checkpoints.list() if e.top1 is not None), default=None)
        # (swarm epoch, swarm emptied) of the last failed download: wait for a newer epoch, or for the swarm to empty
        # (its last peers then keep their state up for this coordinator: hivetrain.hand_over)
        self._failed_at: Optional[tuple[int, bool]] = None

    def run(self, stop: threading.Event, poll: float = 1.0) -> None:
        while not stop.is_set():
            try:
                self.tick()
            except Exception:  # the loop outlives anything one validation does wrong; the traceback says what
                logger.exception("Validation failed; trying again at the next epoch")
                self._failed_at = self._newest()
            stop.wait(poll)

    def tick(self) -> Optional[ValidationRow]:
        """One look at the swarm: download and validate when a state `every` epochs newer than the last exists, or
        any newer one once no peer trains."""
        swarm_epoch, emptied = self._newest()
        due = emptied or self.validated is None or swarm_epoch >= self.validated + self.every
        if due and swarm_epoch > self.holder.epoch and (swarm_epoch, emptied) != self._failed_at:
            if not self._load(swarm_epoch, emptied):
                return None
        if not self.holder.has_state or self.validated is not None and (
                self.holder.epoch <= self.validated if emptied else self.holder.epoch < self.validated + self.every):
            return None
        return self.validate()

    def _newest(self) -> tuple[int, bool]:
        """The newest epoch there is a state of, and whether no peer trains any more (its last peers' then)."""
        swarm_epoch, last_peers = self.swarm_epoch(), self.last_peers_epoch()
        if last_peers is None:
            return swarm_epoch, False
        return max(swarm_epoch, last_peers), True

    def _load(self, swarm_epoch: int, emptied: bool) -> bool:
        for attempt in range(1, self.attempts + 1):
            try:
                if self.holder.load_from_peers():
                    self._failed_at = None
                    return True
                problem = "no peer served a newer state"
            except Exception as e:  # a peer's fault (a dropped stream, garbage) must not end the monitor
                problem = f"{type(e).__name__}: {e}"
            if attempt < self.attempts:
                time.sleep(self.backoff * 2 ** (attempt - 1))
        logger.warning(f"Could not load the swarm's state at epoch {swarm_epoch} after {self.attempts} attempts"
                       f" ({problem}); trying again at the next epoch")
        self._failed_at = (swarm_epoch, emptied)
        return False

    def validate(self) -> ValidationRow:
        epoch = self.holder.epoch
        metrics = evaluate(self.holder.model, self.loader, self.device)
        row = ValidationRow(time=time.time(), epoch=epoch, loss=metrics["loss"], top1=metrics["top1"],
                            top5=metrics["top5"], samples=metrics["samples"])
        self.writer.add_validation(row)
        self.validated = epoch
        for scalars in self.loggers:
            for name in ("loss", "top1", "top5"):
                scalars.add_scalar(f"val/{name}", getattr(row, name), epoch, walltime=row.time)
        degraded = self._degraded(row)
        is_best = degraded is None and (self.best_top1 is None or row.top1 > self.best_top1)
        self.report(f"validation at swarm epoch {epoch}: top-1 {row.top1:.4f}, top-5 {row.top5:.4f},"
                    f" loss {row.loss:.4f}{' (best so far)' if is_best else ''}")
        if is_best:
            self.best_top1 = row.top1
            self._save_best(row)
        elif degraded is not None:
            self._roll_back(row, degraded)
        return row

    def _degraded(self, row: ValidationRow) -> Optional[str]:
        """What calls for a rollback, in the words of the peers' line ("the coordinator saw ..."), or None."""
        if self.rollback_drop is None or self.best_top1 is None:
            return None
        if not math.isfinite(row.loss):
            return f"the validation loss turn {row.loss}"
        if row.top1 < self.best_top1 - self.rollback_drop / 100:
            return f"top-1 fall to {row.top1:.1%}"
        return None

    def _roll_back(self, row: ValidationRow, reason: str) -> None:
        try:
            best = self.checkpoints.load()  # the best: the one on record, also that of a coordinator before a restart
        except CheckpointError as e:
            logger.warning(f"Cannot roll back: the best checkpoint does not load ({e})")
            return
        best_top1 = float(best.metrics.get("top1", self.best_top1))
        restored = max(self.swarm_epoch(), row.epoch) + ROUNDS_AHEAD
        self.holder.roll_back(best, restored)
        self.validated = restored  # the next validation is of what the swarm trains from the restored state
        record = RollbackRecord(run_id=best.config.run_id, sequence=self.writer.last_rollback_sequence() + 1,
                                epoch=best.epoch, top1=best_top1, round=restored, reason=reason, time=time.time())
        self.writer.add_rollback(RollbackRow(time=record.time, sequence=record.sequence, epoch=row.epoch,
                                             top1=row.top1, loss=row.loss, best_epoch=best.epoch, best_top1=best_top1,
                                             restored_epoch=restored))
        for scalars in self.loggers:
            scalars.add_scalar("rollback/best_epoch", best.epoch, row.epoch, walltime=record.time)
        # said before it is published: no peer's line about a rollback comes before the coordinator's
        self.report(f"Rollback {record.sequence}: validation at swarm epoch {row.epoch} saw {reason}; the swarm goes"
                    f" back to the best validated state (swarm epoch {best.epoch}, top-1 {best_top1:.1%}), served as"
                    f" swarm epoch {restored}")
        self.publish_rollback(record)

    def _save_best(self, row: ValidationRow) -> None:
        metrics = dict(epoch=row.epoch, top1=row.top1, top5=row.top5, loss=row.loss, samples=row.samples, time=row.time)
        uri = self.checkpoints.save(self.holder.checkpoint(metrics), best=True)
        size = next((entry.size for entry in self.checkpoints.list() if entry.uri == uri), 0)
        self.writer.add_checkpoint(CheckpointRow(time=time.time(), epoch=row.epoch, uri=uri, size_bytes=size,
                                                 top1=row.top1, best=True))
        for scalars in self.loggers:  # the last of each is the best: W&B's run summary shows them
            scalars.add_scalar("checkpoint/best_top1", row.top1, row.epoch, walltime=row.time)
            scalars.add_scalar("checkpoint/best_epoch", row.epoch, row.epoch, walltime=row.time)
            scalars.add_text("checkpoint/best_uri", uri, row.epoch)
        self.report(f"best checkpoint: {uri}")
