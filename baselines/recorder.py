"""A Lightning callback that measures a run for the run result it writes (hivetrain.run_result): time, samples,
validation per epoch, the best weights, peak memory and utilisation of every rank, and FSDP's shard sizes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch.distributed as dist

from baselines.utilisation import NvidiaSmiLog, UtilisationSampler, peak_memory
from baselines.sharded import StateDict, full_state_dict, parameter_bytes
from hivetrain.config import RunConfig
from hivetrain.model import save_weights
from hivetrain.run_result import PipelineLayout, RankMemory, Sharding, UtilisationSample, ValidationPoint


@dataclass
class RunStats:
    """What a run measured, all ranks together; the run result adds the run's settings."""

    validation: list[ValidationPoint] = field(default_factory=list)
    memory: list[RankMemory] = field(default_factory=list)
    utilisation: list[UtilisationSample] = field(default_factory=list)
    train_samples: int = 0
    epochs: int = 0
    steps: int = 0
    wall_time_s: float = 0.0
    train_time_s: float = 0.0
    best_top1: Optional[float] = None
    best_checkpoint: Optional[str] = None
    sharding: Optional[Sharding] = None
    pipeline: Optional[PipelineLayout] = None
    nvidia_smi_log: Optional[str] = None

    def end_training(self, started: float, val_time: float, steps: int) -> None:
        """Training ended now: wall time since `started` (time.monotonic()), the same without validation, and the
        optimizer steps taken."""
        ended = time.monotonic()
        self.wall_time_s = round(ended - started, 3)
        self.train_time_s = round(ended - started - val_time, 3)
        self.steps = steps


class RunRecorder(pl.Callback):
    """Measures the run on every rank; rank 0's `stats` go into the run result that baselines/run.py writes."""

    def __init__(self, config: RunConfig, best_path: Optional[Path], final_path: Optional[Path],
                 nvidia_smi_path: Path, sharded: bool):
        self.config, self.best_path, self.final_path, self.sharded = config, best_path, final_path, sharded
        self.nvidia_smi = NvidiaSmiLog(nvidia_smi_path)
        self.stats = RunStats()
        self._samples = 0  # this rank's
        self._val_time = 0.0
        self._val_started: Optional[float] = None
        self._started = 0.0
        self._sampler: Optional[UtilisationSampler] = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._sampler = UtilisationSampler(trainer.global_rank, trainer.strategy.root_device)
        self._sampler.start()
        if trainer.local_rank == 0:  # one raw log per node: nvidia-smi sees all of the node's GPUs
            self.nvidia_smi.start()
        self._started = time.monotonic()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._samples += len(batch[1])

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.stats.epochs += 1

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._val_started = time.monotonic()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After the epoch's metrics are computed (on_validation_epoch_end runs before Lightning aggregates them).
        if trainer.sanity_checking or self._val_started is None:
            return
        now = time.monotonic()
        metrics = trainer.callback_metrics
        # top-1/top-5 are torchmetrics objects, synchronised across ranks; the module logs val/loss per rank without
        # sync_dist, so average it here (every rank sees equally many samples under DistributedSampler).
        loss = trainer.strategy.reduce(metrics["val/loss"].detach().to(trainer.strategy.root_device), reduce_op="mean")
        point = ValidationPoint(
            epoch=trainer.current_epoch + 1, step=trainer.global_step, time_s=round(now - self._started, 3),
            # float32 metrics: 1.0000001 would read as more than 100%
            loss=round(float(loss), 6), top1=round(float(metrics["val/top1"]), 6),
            top5=round(float(metrics["val/top5"]), 6),
        )
        self.stats.validation.append(point)
        # Rank 0 decides, so every rank joins the same collectives when the weights are sharded.
        improved = trainer.strategy.broadcast(self.stats.best_top1 is None or point.top1 > self.stats.best_top1)
        if improved:
            self.stats.best_top1 = point.top1
            if self.best_path is not None:
                self._save(trainer, pl_module, self.best_path, point.epoch)
        # Validation and keeping the best weights are not training: train_time_s (and samples/s) leaves them out.
        self._val_time += time.monotonic() - self._val_started
        self._val_started = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.stats.end_training(self._started, self._val_time, trainer.global_step)
        samples = self._sampler.stop() if self._sampler is not None else []
        self.nvidia_smi.stop()
        if trainer.is_global_zero and self.nvidia_smi.path is not None:
            self.stats.nvidia_smi_log = str(self.nvidia_smi.path)
        if self.final_path is not None:
            self._save(trainer, pl_module, self.final_path, self.stats.epochs)
        local, total = getattr(pl_module, "param_bytes", None) or parameter_bytes(pl_module.model)
        mine = dict(memory=peak_memory(trainer.global_rank, trainer.strategy.root_device), samples=samples,
                    trained=self._samples, param_bytes=local)
        ranks = _gather(mine)
        self.stats.memory = [r["memory"] for r in ranks]
        self.stats.utilisation = [s for r in ranks for s in r["samples"]]
        self.stats.train_samples = sum(r["trained"] for r in ranks)
        if self.sharded:
            self.stats.sharding = Sharding(total_param_bytes=total,
                                           per_rank_param_bytes=[r["param_bytes"] for r in ranks])

    def _save(self, trainer: pl.Trainer, pl_module: pl.LightningModule, path: Path, epoch: int) -> None:
        if self.sharded:
            state = full_state_dict(pl_module.model)  # a collective: every rank gathers, rank 0 keeps the result
            if trainer.is_global_zero:
                save_weights(path, StateDict(state), self.config, epoch)
        elif trainer.is_global_zero:
            save_weights(path, pl_module.model, self.config, epoch)


def _gather(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (on every rank); just [obj] without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out

