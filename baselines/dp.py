"""torch.nn.DataParallel: one process drives all GPUs of a node, splitting every batch across them.

Lightning 2.x removed its DP strategy, so this is a small training loop of its own around the same model, optimizer,
schedule and data as the other strategies (hivetrain.model, hivetrain.optimizer.make_optimizer, the data module) and the
same measurements. DataParallel replicates the model onto every GPU at each forward and gathers outputs on the first
GPU: it is the baseline that shows why DDP exists, not a recommended way to train.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from baselines.utilisation import NvidiaSmiLog, UtilisationSampler, peak_memory
from baselines.recorder import RunStats
from hivetrain.config import RunConfig
from hivetrain.data import ImageDataModule
from hivetrain.evaluate import evaluate
from hivetrain.model import autocast_dtype, create_model, save_weights
from hivetrain.optimizer import make_optimizer
from hivetrain.run_result import ValidationPoint


def train_data_parallel(config: RunConfig, datamodule: ImageDataModule, devices: int, accumulate: int, precision: str,
                        epochs: int, max_steps: int, validate: bool, pretrained_weights: Optional[str],
                        best_path: Path, final_path: Optional[Path], loggers: list, nvidia_smi_path: Path) -> RunStats:
    """`loggers` are Lightning loggers (TensorBoard, W&B), written to as a Trainer would."""
    gpus = [torch.device("cuda", i) for i in range(devices)]
    model = create_model(config.model, pretrained_weights, seed=config.seed).to(gpus[0])
    parallel = torch.nn.DataParallel(model, device_ids=[g.index for g in gpus])
    optimizer, scheduler = make_optimizer(model, config.optim)
    dtype = autocast_dtype(precision)
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "16-mixed")  # fp16 gradients need loss scaling
    train_loader = datamodule.train_dataloader()
    val_loader = datamodule.val_dataloader() if validate else None

    stats = RunStats()
    samplers = [UtilisationSampler(i, g) for i, g in enumerate(gpus)]
    nvidia_smi = NvidiaSmiLog(nvidia_smi_path)
    for sampler in samplers:
        sampler.start()
    nvidia_smi.start()
    started = time.monotonic()
    val_time = 0.0
    step = 0

    def optimizer_step(loss: torch.Tensor) -> None:
        nonlocal step
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()  # per optimizer step, as in ImageClassifier
        step += 1
        for logger in loggers:
            logger.log_metrics({"train/loss": loss.item() * accumulate}, step=step)

    for epoch in range(epochs):
        model.train()
        micro = 0
        for images, labels in train_loader:
            images, labels = images.to(gpus[0], non_blocking=True), labels.to(gpus[0], non_blocking=True)
            with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
                loss = F.cross_entropy(parallel(images), labels) / accumulate  # the mean over the optimizer step
            scaler.scale(loss).backward()
            stats.train_samples += len(labels)
            micro += 1
            if micro % accumulate == 0:
                optimizer_step(loss)
                if step == max_steps:
                    break
        if micro % accumulate and step != max_steps:  # like Lightning: an epoch's last partial accumulation steps too
            optimizer_step(loss)
        stats.epochs = epoch + 1
        if val_loader is not None:
            val_started = time.monotonic()
            metrics = evaluate(model, val_loader, gpus[0])  # the unwrapped model on one GPU: no gather needed
            val_time += time.monotonic() - val_started
            point = ValidationPoint(epoch=epoch + 1, step=step, time_s=round(time.monotonic() - started, 3),
                                    loss=metrics["loss"], top1=metrics["top1"], top5=metrics["top5"])
            stats.validation.append(point)
            for logger in loggers:
                logger.log_metrics({"val/loss": point.loss, "val/top1": point.top1, "val/top5": point.top5}, step=step)
            if stats.best_top1 is None or point.top1 > stats.best_top1:
                stats.best_top1 = point.top1
                save_weights(best_path, model, config, point.epoch)
        if step == max_steps:
            break
    stats.end_training(started, val_time, step)
    nvidia_smi.stop()
    stats.nvidia_smi_log = str(nvidia_smi.path) if nvidia_smi.path is not None else None
    stats.utilisation = [s for sampler in samplers for s in sampler.stop()]
    # One process: every GPU's peak is read here; the process RSS is the same for all of them.
    stats.memory = [peak_memory(i, g) for i, g in enumerate(gpus)]
    if final_path is not None:
        save_weights(final_path, model, config, stats.epochs)
    for logger in loggers:
        logger.finalize("success")
    return stats
