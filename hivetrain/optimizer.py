"""The run's optimizer: AdamW with its hyperparameters and a warmup + cosine schedule counted in optimizer steps
(swarm epochs when training in a swarm). Free of Lightning: the coordinator builds the same optimizer state as every
peer without importing it (hivetrain.module is the LightningModule that trains with it)."""

from __future__ import annotations

import math
from functools import partial

import torch

from hivetrain.config import OptimConfig


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
