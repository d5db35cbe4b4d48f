"""The LightningModule every role shares: cross-entropy classification with top-1/top-5 accuracy, AdamW and a
warmup + cosine schedule counted in optimizer steps (swarm epochs when training in a swarm)."""

from __future__ import annotations

import math
from functools import partial

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torchmetrics.classification import MulticlassAccuracy

from hivetrain.config import OptimConfig, RunConfig


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier at optimizer step `step`: linear warmup from 1/warmup_steps, then cosine down to min_lr_ratio."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, optim: OptimConfig) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with the run's hyperparameters and its warmup + cosine schedule, for `model` where it is now: fused
    (one CUDA kernel for all parameters, hivetrain.speedups) when its parameters are on CUDA, torch's default on CPU.

    Args:
        model: the model, already on its training device (Lightning calls configure_optimizers after moving it).
        optim: the run's optimizer settings.
    """
    # No weight decay on biases, norms, position embeddings and tokens (1-d or special parameters), as in timm.
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim <= 1 or name.endswith(("pos_embed", "cls_token", "reg_token")) else decay).append(param)
    on_cuda = bool(decay or no_decay) and all(p.device.type == "cuda" for p in decay + no_decay)
    optimizer = torch.optim.AdamW(
        [dict(params=decay, weight_decay=optim.weight_decay), dict(params=no_decay, weight_decay=0.0)],
        lr=optim.lr,
        betas=optim.betas,
        fused=True if on_cuda else None,  # None: torch's choice (foreach), as before fusing existed here
    )
    schedule = partial(
        warmup_cosine, warmup_steps=optim.warmup_steps, total_steps=optim.total_steps, min_lr_ratio=optim.min_lr_ratio
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


class ImageClassifier(pl.LightningModule):
    def __init__(self, config: RunConfig, model: torch.nn.Module, compile_model: bool = False):
        """Args:
            config: the run (number of classes, optimizer and schedule).
            model: the network; the module trains it in place.
            compile_model: compile the model's forward with torch.compile (--compile). nn.Module.compile compiles in
                place: the parameters stay the very tensors the swarm averages, and state_dict keys stay clean (no
                `_orig_mod.` prefix of a torch.compile wrapper in checkpoints). Compilation happens at the first step.
        """
        super().__init__()
        self.config = config
        self.model = model
        if compile_model:
            model.compile()
        classes = config.model.num_classes
        # micro: the fraction of samples classified right, as hivetrain.evaluate counts it (not a mean over classes)
        # validate_args off for the training batches, which are this process's own: torchmetrics' checks of the labels
        # read them on the host, which would make the GPU wait for it at every step
        self.train_top1 = MulticlassAccuracy(classes, top_k=1, average="micro", validate_args=False)
        self.val_top1 = MulticlassAccuracy(classes, top_k=1, average="micro")
        self.val_top5 = MulticlassAccuracy(classes, top_k=min(5, classes), average="micro")

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        logits = self(images)
        loss = F.cross_entropy(logits, labels)
        self.train_top1(logits, labels)
        # Not on the progress bar: Lightning reads every progress-bar value on the host at each step's end, which makes
        # the GPU drain and then wait through the loop's work between two steps (a peer's epoch lines show the loss).
        self.log("train/loss", loss)
        self.log("train/top1", self.train_top1)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self.val_top1(logits, labels)
        self.val_top5(logits, labels)
        self.log("val/loss", F.cross_entropy(logits, labels), prog_bar=True)
        self.log("val/top1", self.val_top1, prog_bar=True)
        self.log("val/top5", self.val_top5)

    def configure_optimizers(self):
        optimizer, scheduler = make_optimizer(self.model, self.config.optim)
        return dict(optimizer=optimizer, lr_scheduler=dict(scheduler=scheduler, interval="step"))
