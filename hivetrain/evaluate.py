"""Validation metrics of a model on the run's validation split."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader, device: str | torch.device = "cpu") -> dict[str, float]:
    """Mean cross-entropy, top-1 and top-5 accuracy over the whole loader."""
    was_training = model.training
    model.eval().to(device)
    total = loss = top1 = top5 = 0.0
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        logits = model(images)
        loss += F.cross_entropy(logits, labels, reduction="sum").item()
        best = logits.topk(min(5, logits.shape[1]), dim=1).indices
        top1 += (best[:, 0] == labels).sum().item()
        top5 += (best == labels[:, None]).any(dim=1).sum().item()
        total += len(labels)
    model.train(was_training)
    return dict(loss=loss / total, top1=top1 / total, top5=top5 / total, samples=int(total))
