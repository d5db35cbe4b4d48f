"""The coordinator's watch over the swarm: who is training and how fast (SwarmMonitor), and how good the shared model
is (Validator, which also keeps the best checkpoint). Both write to the metrics store and to `loggers`: TensorBoard's
SummaryWriter, and W&B's run behind the same calls (hivetrain.wandb_run.WandbScalars). Neither ever stops on what a
peer did or failed to do."""

from __future__ import annotations

import logging
import math
import threading
import time
from statistics import mean
from typing import Callable, Optional, Sequence

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from torch.utils.data import DataLoader

from hivetrain.checkpoint import CheckpointError, CheckpointStore
from hivetrain.clock import read_clock, swarm_epoch
from hivetrain.config import RunConfig
from hivetrain.diloco import next_round_time, paced_round_samples
from hivetrain.evaluate import evaluate
from hivetrain.metrics_store import CheckpointRow, MetricsWriter, PeerRow, RollbackRow, SwarmSnapshot, ValidationRow
from hivetrain.rollback import ROUNDS_AHEAD, RollbackRecord
from hivetrain.telemetry import PeerIdOwners, bounded_sum, finite_or_none, read_peer_records, read_swarm_progress

logger = logging.getLogger(__name__)


class SwarmMonitor:
    def __init__(self, dht: hivemind.DHT, config: RunConfig, writer: MetricsWriter, loggers: Sequence = (),
                 start_epoch: int = 0):
        self.dht, self.config, self.writer, self.loggers = dht, config, writer, loggers
        self.start_epoch = start_epoch  # a resumed run starts at its checkpoint's epoch
        self.latest: Optional[SwarmSnapshot] = None
        self.owners = PeerIdOwners()  # one row per peer ID, written by the key that first claimed it

    @property
    def epoch(self) -> int:
        """The swarm's epoch by this monitor's count so far (hivetrain.clock.swarm_epoch)."""
        return self.latest.epoch if self.latest else self.start_epoch

    def refresh(self) -> SwarmSnapshot:
        """Read every peer's record and hivemind's progress, aggregate, and record both."""
        now = time.time()
        # A coordinator restarted on its identity goes on from the count it published before (its signed clock
        # lives on in the swarm a while), not from 0: peers read a count that goes back as a restart, but a lone
        # peer far ahead of 0 would never move it (hivetrain.clock.swarm_epoch).
        published = read_clock(self.dht, self.config.run_id, RSASignatureValidator().local_public_key)
        counted = max(self.epoch, published.epoch if published is not None else 0)
        records = read_peer_records(self.dht, self.config.run_id, self.owners)
        progress = read_swarm_progress(self.dht, self.config.run_id, counted)
        # Seen, first seen and left by this look's clock, never by a peer's (its `time` may be anything: a record
        # dated a century ahead would keep a peer "online" for ever and break every date shown).
        self.writer.upsert_peers([
            PeerRow(peer_id=r.peer_id, name=r.name, hardware=r.hardware, client_mode=r.client_mode, epoch=r.epoch,
                    samples_per_second=r.samples_per_second, loss=r.loss, samples=r.samples, first_seen=now,
                    last_seen=now, inner_steps=r.inner_steps, pseudo_gradient_norm=r.pseudo_gradient_norm,
                    round_bytes=r.round_bytes, train_seconds=r.train_seconds, swarm_seconds=r.swarm_seconds,
                    left_at=now if r.left else None, rounds_averaged=r.rounds_averaged, rounds_alone=r.rounds_alone,
                    rounds_failed=r.rounds_failed)
            for r in records
        ])
        self.writer.mark_left({r.peer_id for r in records}, now)  # killed or cut off: their records lapsed
        # A leaver's last record still says how far the swarm got: peers that stop at an epoch withdraw their
        # progress records within a second of reaching it, often before this look could read them.
        reached = swarm_epoch(counted, [r.epoch for r in records])  # no one record sets it (hivetrain.clock)
        records = [r for r in records if not r.left]
        # What the peers really train per wall-clock second, rounds and state downloads included: each peer's record
        # counts its samples between two records over the time between them. (hivemind's progress records carry a
        # compute-only rate that leaves the rounds out: on the sync demo about 20 times what the peers trained.)
        samples_per_second = bounded_sum(r.samples_per_second for r in records)
        swarm = self.config.swarm
        # diloco: a round is due after H steps of the run's batch per peer (hivetrain.diloco.RoundTracker), or, paced
        # in seconds, at its time on the clock's grid, after what the swarm trains in that time
        target = (swarm.inner_steps * self.config.batch_size * max(1, progress.peers) if swarm.mode == "diloco"
                  else swarm.target_batch_size)
        remaining = max(0, target - progress.samples_accumulated)
        eta = finite_or_none(remaining / samples_per_second) if samples_per_second > 0 else None
        if swarm.mode == "diloco" and swarm.round_seconds:
            target = paced_round_samples(samples_per_second, swarm.round_seconds)
            eta = next_round_time(now, swarm.round_seconds) - now
        losses = [r.loss for r in records if r.loss is not None]
        snapshot = SwarmSnapshot(
            time=now,
            # the run's epoch never goes back, even when every peer has left and their records expired
            epoch=max(progress.epoch, reached, counted),
            alive_peers=len(records),
            clients=sum(r.client_mode for r in records),
            samples_per_second=samples_per_second,
            samples_accumulated=progress.samples_accumulated,
            target_batch_size=target,
            eta_seconds=eta,
            mean_loss=mean(losses) if losses else None,
        )
        self.writer.add_snapshot(snapshot)
        for scalars in self.loggers:
            for name in ("alive_peers", "samples_per_second", "mean_loss"):
                value = getattr(snapshot, name)
                if value is not None:
                    scalars.add_scalar(f"swarm/{name}", value, snapshot.epoch, walltime=now)
        self.latest = snapshot
        return snapshot


class Validator:
    """Every `every` swarm epochs: download the newest state, evaluate it, and save a checkpoint on a new best top-1.

    `holder` is the coordinator's StateHolder (anything with load_from_peers(), epoch, has_state, model,
    checkpoint(metrics) and roll_back(checkpoint, epoch)); `swarm_epoch` tells where the swarm is; `loggers` are
    SummaryWriter-like (add_scalar, add_text).

    With `rollback_drop` (top-1 points), a validation whose top-1 is more than that below the best, or whose loss is
    not finite, rolls the swarm back: the holder serves the best checkpoint's state again, numbered ROUNDS_AHEAD
    swarm epochs ahead of the swarm (peers take no state older than theirs, and the epochs keep counting forward), and
    `publish_rollback` gets the signed record's content for the peers.
    """

    def __init__(self, holder, loader: DataLoader, writer: MetricsWriter, checkpoints: CheckpointStore,
                 swarm_epoch: Callable[[], int], every: int = 1, device: str = "cpu", loggers: Sequence = (),
                 attempts: int = 3, backoff: float = 1.0, report: Callable[[str], None] = print,
                 rollback_drop: Optional[float] = None,
                 publish_rollback: Callable[[RollbackRecord], None] = lambda record: None):
        self.holder, self.loader, self.writer, self.checkpoints = holder, loader, writer, checkpoints
        self.swarm_epoch, self.every, self.device, self.loggers = swarm_epoch, every, device, loggers
        self.attempts, self.backoff, self.report = attempts, backoff, report
        self.rollback_drop, self.publish_rollback = rollback_drop, publish_rollback
        self.validated: Optional[int] = None  # the epoch of the last validation
        # A restarted coordinator keeps beating the best it saved before, not merely its first validation.
        self.best_top1: Optional[float] = max((e.top1 for e in checkpoints.list() if e.top1 is not None), default=None)
        self._failed_at: Optional[int] = None  # the swarm epoch of the last failed download: wait for a newer one

    def run(self, stop: threading.Event, poll: float = 1.0) -> None:
        while not stop.is_set():
            try:
                self.tick()
            except Exception:  # the loop outlives anything one validation does wrong; the traceback says what
                logger.exception("Validation failed; trying again at the next epoch")
                self._failed_at = self.swarm_epoch()
            stop.wait(poll)

    def tick(self) -> Optional[ValidationRow]:
        """One look at the swarm: download and validate when a state `every` epochs newer than the last exists."""
        swarm_epoch = self.swarm_epoch()
        due = self.validated is None or swarm_epoch >= self.validated + self.every
        if due and swarm_epoch > self.holder.epoch and swarm_epoch != self._failed_at:
            if not self._load(swarm_epoch):
                return None
        if not self.holder.has_state or (self.validated is not None and self.holder.epoch < self.validated + self.every):
            return None
        return self.validate()

    def _load(self, swarm_epoch: int) -> bool:
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
        self._failed_at = swarm_epoch
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
