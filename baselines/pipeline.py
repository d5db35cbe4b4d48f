"""Pipeline parallelism: the ViT's blocks split into one stage per process, micro-batches flowing through the stages
under torch.distributed.pipelining's 1F1B or GPipe schedule.

Stage 0 also runs the patch embedding (with the class token and position embedding), the last stage the final norm
and the head. Lightning has no pipeline strategy, so this is a small training loop of its own around the same model,
optimizer, schedule and data as the other strategies (hivetrain.model, hivetrain.optimizer.make_optimizer, the data
module); its processes are started like DDP's, by Lightning's launcher (Fabric), which also reads torchrun, SLURM and
MASTER_ADDR/NODE_RANK. Every rank reads the same batches in the same order: stage 0 uses the images, the last stage
the labels.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from baselines.utilisation import NvidiaSmiLog, UtilisationSampler, peak_memory
from baselines.recorder import RunStats
from baselines.sharded import StateDict
from hivetrain.config import RunConfig
from hivetrain.data import ImageDataModule
from hivetrain.evaluate import score
from hivetrain.model import autocast_dtype, create_model, save_weights
from hivetrain.optimizer import make_optimizer
from hivetrain.run_result import PipelineLayout, Sharding, ValidationPoint

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


class ViTStage(nn.Module):
    """Stage `stage` of `num_stages` of a timm VisionTransformer: an even share of its blocks, plus the embedding on
    the first stage and the norm and head on the last. The parts other stages run are dropped from `model` in place,
    so parameter names stay the whole model's: the stages' state dicts together are the model's state dict."""

    def __init__(self, model: nn.Module, stage: int, num_stages: int):
        super().__init__()
        depth = len(model.blocks)
        if not 1 <= num_stages <= depth:
            raise ValueError(f"{num_stages} pipeline stages for a model of {depth} blocks: at most one stage per block")
        self.first, self.last = stage == 0, stage == num_stages - 1
        self.block_range = range(stage * depth // num_stages, (stage + 1) * depth // num_stages)
        for i in range(depth):
            if i not in self.block_range:
                model.blocks[i] = nn.Identity()
        if not self.first:
            model.patch_embed, model.norm_pre = nn.Identity(), nn.Identity()
            for name in ("cls_token", "reg_token", "pos_embed"):
                setattr(model, name, None)  # a None parameter leaves the state dict
        if not self.last:
            model.norm, model.fc_norm, model.head, model.attn_pool = nn.Identity(), nn.Identity(), nn.Identity(), None
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.model  # the steps of timm's forward_features and forward_head, this stage's share of them
        if self.first:
            x = m.norm_pre(m.patch_drop(m._pos_embed(m.patch_embed(x))))
        for i in self.block_range:
            x = m.blocks[i](x)
        if self.last:
            return m.forward_head(m.norm(x))
        return x.contiguous()  # gloo sends only contiguous tensors; a block's output can be a strided view

    def describe(self) -> str:
        """What this stage runs, e.g. 'embedding, blocks 0-5'."""
        parts = ["embedding"] if self.first else []
        r = self.block_range
        parts.append(f"block {r.start}" if len(r) == 1 else f"blocks {r.start}-{r.stop - 1}")
        return ", ".join(parts + (["norm, head"] if self.last else []))


class PipelineTrainer:
    """One rank's stage, its optimizer and the schedule that moves micro-batches through all stages. Every rank calls
    the same methods with the same batches, in step (they are collectives)."""

    def __init__(self, config: RunConfig, model: nn.Module, device: torch.device, schedule: str, microbatches: int,
                 accumulate: int = 1, precision: str = "32"):
        self.rank, self.num_stages = dist.get_rank(), dist.get_world_size()
        self.stage = ViTStage(model, self.rank, self.num_stages).to(device)
        self.device, self.microbatches, self.accumulate = device, microbatches, accumulate
        self.dtype = autocast_dtype(precision)
        self.optimizer, self.scheduler = make_optimizer(self.stage.model, config.optim)
        pipe_stage = PipelineStage(self.stage, self.rank, self.num_stages, device)
        # Each micro-batch's loss is divided by all micro-batches of the optimizer step, and the schedule does not
        # rescale: gradients add up over the step's schedule runs to those of the mean loss over its whole batch.
        self.schedule = SCHEDULES[schedule](pipe_stage, microbatches, loss_fn=self._loss, scale_grads=False)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, labels) / (self.microbatches * self.accumulate)

    def _run(self, images: torch.Tensor, labels: torch.Tensor, losses: Optional[list], train: bool):
        inputs = (images.to(self.device),) if self.stage.first else ()
        target = labels.to(self.device) if self.stage.last else None
        with torch.autocast(self.device.type, dtype=self.dtype or torch.bfloat16, enabled=self.dtype is not None):
            if train:
                return self.schedule.step(*inputs, target=target, losses=losses, return_outputs=False)
            return self.schedule.eval(*inputs, target=target)

    def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """One optimizer step over `accumulate` batches; returns the mean loss (on every rank)."""
        self.stage.train()
        total = 0.0
        for images, labels in batches:
            losses: list[torch.Tensor] = []  # the schedule refills it each run
            self._run(images, labels, losses, train=True)
            total += sum(loss.item() for loss in losses)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()  # per optimizer step, as in ImageClassifier
        loss = torch.tensor(total, device=self.device)
        dist.broadcast(loss, src=self.num_stages - 1)  # only the last stage has it; rank 0 logs it
        return loss.item()

    @torch.no_grad()
    def validate(self, loader, batch_size: int) -> Optional[dict[str, float]]:
        """Loss, top-1 and top-5 over the whole loader as hivetrain.evaluate counts them, on the last stage (None on
        the others). The schedule's shapes are fixed by training, so a short last batch is padded and the padding
        left out of the metrics."""
        self.stage.eval()
        total = loss = top1 = top5 = 0.0
        for images, labels in loader:
            n = len(labels)
            if n < batch_size:
                images = torch.cat([images, images.new_zeros((batch_size - n, *images.shape[1:]))])
                labels = torch.cat([labels, labels.new_zeros(batch_size - n)])
            logits = self._run(images, labels, None, train=False)
            if self.stage.last:
                batch_loss, batch_top1, batch_top5 = score(logits[:n].float(), labels[:n].to(self.device))
                loss, top1, top5 = loss + batch_loss, top1 + batch_top1, top5 + batch_top5
            total += n
        self.stage.train()
        return dict(loss=loss / total, top1=top1 / total, top5=top5 / total) if self.stage.last else None

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights on rank 0 (every stage's, on CPU), an empty dict on the others. A collective."""
        mine = {k: v.detach().cpu() for k, v in self.stage.model.state_dict().items()}
        parts: Optional[list] = [None] * self.num_stages if self.rank == 0 else None
        dist.gather_object(mine, parts, dst=0)
        return {k: v for part in parts for k, v in part.items()} if parts is not None else {}

    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.stage.parameters())


def train_pipeline(config: RunConfig, datamodule: ImageDataModule, device_type: str, devices: int, num_nodes: int,
                   schedule: str, microbatches: int, accumulate: int, precision: str, epochs: int, max_steps: int,
                   validate: bool, pretrained_weights: Optional[str], best_path: Path, final_path: Optional[Path],
                   loggers: list, nvidia_smi_path: Path) -> Optional[RunStats]:
    """Start the node's other processes (each runs this same command), train, and return the run's stats on rank 0;
    None on the other ranks. `loggers` are Lightning loggers (TensorBoard, W&B), written to as a Trainer would."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator=device_type, devices=devices, num_nodes=num_nodes, strategy="ddp")
    fabric.launch()  # the process group: gloo on CPUs, NCCL on GPUs; the model is not wrapped
    rank, device = fabric.global_rank, fabric.device
    model = create_model(config.model, pretrained_weights, seed=config.seed)  # the same weights on every rank
    trainer = PipelineTrainer(config, model, device, schedule, microbatches, accumulate, precision)
    del model  # the stage kept its share; the rest is freed
    total_params = torch.tensor(trainer.parameter_bytes(), device=device)
    dist.all_reduce(total_params)
    train_loader = datamodule.train_dataloader()
    val_loader = datamodule.val_dataloader() if validate else None

    stats = RunStats()
    sampler = UtilisationSampler(rank, device)
    nvidia_smi = NvidiaSmiLog(nvidia_smi_path)
    sampler.start()
    if fabric.local_rank == 0:  # one raw log per node: nvidia-smi sees all of the node's GPUs
        nvidia_smi.start()
    started = time.monotonic()
    val_time = 0.0
    step = 0
    for epoch in range(epochs):
        pending: list = []
        for images, labels in train_loader:
            pending.append((images, labels))
            if len(pending) < accumulate:  # an epoch's last partial accumulation is left out
                continue
            loss = trainer.train_step(pending)
            stats.train_samples += sum(len(labels) for _, labels in pending)
            pending = []
            step += 1
            for logger in loggers:  # rank 0 only, as all Lightning loggers
                logger.log_metrics({"train/loss": loss}, step=step)
            if step == max_steps:
                break
        stats.epochs = epoch + 1
        if val_loader is not None:
            val_started = time.monotonic()
            metrics = trainer.validate(val_loader, datamodule.batch_size)
            shared = [metrics]
            dist.broadcast_object_list(shared, src=trainer.num_stages - 1)  # the last stage has the logits
            metrics = shared[0]
            point = ValidationPoint(epoch=epoch + 1, step=step, time_s=round(time.monotonic() - started, 3),
                                    loss=round(metrics["loss"], 6), top1=round(metrics["top1"], 6),
                                    top5=round(metrics["top5"], 6))
            stats.validation.append(point)
            for logger in loggers:
                logger.log_metrics({"val/loss": point.loss, "val/top1": point.top1, "val/top5": point.top5}, step=step)
            if stats.best_top1 is None or point.top1 > stats.best_top1:  # every rank decides alike
                stats.best_top1 = point.top1
                weights = trainer.full_state_dict()
                if rank == 0:
                    save_weights(best_path, StateDict(weights), config, point.epoch)
            val_time += time.monotonic() - val_started
        if step == max_steps:
            break
    stats.end_training(started, val_time, step)
    nvidia_smi.stop()
    stats.nvidia_smi_log = str(nvidia_smi.path) if nvidia_smi.path is not None and rank == 0 else None
    if final_path is not None:
        weights = trainer.full_state_dict()
        if rank == 0:
            save_weights(final_path, StateDict(weights), config, stats.epochs)
    for logger in loggers:
        logger.finalize("success")
    mine = dict(memory=peak_memory(rank, device), samples=sampler.stop(), param_bytes=trainer.parameter_bytes(),
                stage=trainer.stage.describe())
    ranks: Optional[list] = [None] * trainer.num_stages if rank == 0 else None
    dist.gather_object(mine, ranks, dst=0)
    dist.destroy_process_group()
    if ranks is None:
        return None
    stats.memory = [r["memory"] for r in ranks]
    stats.utilisation = [s for r in ranks for s in r["samples"]]
    stats.sharding = Sharding(total_param_bytes=int(total_params),
                              per_rank_param_bytes=[r["param_bytes"] for r in ranks])
    stats.pipeline = PipelineLayout(schedule=schedule, microbatches=microbatches, stages=[r["stage"] for r in ranks])
    return stats
