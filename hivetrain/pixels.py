"""From stored pixels to the model's input: each dataset's channel statistics, and the batch-wise conversion that a
data module runs on the training device (hivetrain.data, `device_transforms`) and the GPU benchmarks run on theirs.

At the mission's shape a volunteer's CPU cannot keep up with its GPU: resizing CIFAR-10's 32 px images to 224 px and
normalising them one by one runs at about 200-400 images/s per core, where one H100 trains ViT-B/32 at about 9,000.
So the CPU keeps the images small (uint8 at their own size, augmented there), and the device scales, resizes and
normalises whole batches.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

# Per-channel (mean, std) of each training split, pixels scaled to [0, 1]; grayscale sets repeat their one
# channel value three times because they are replicated to RGB before normalising.
DATASET_STATS: dict[str, tuple[tuple[float, float, float], tuple[float, float, float]]] = {
    # load_digits().images / 16 on our 1,437-image train split (RandomState(0) permutation), at native 8x8.
    "digits": ((0.3056,) * 3, (0.3763,) * 3),
    # train-images-idx3-ubyte from Debian's dataset-fashion-mnist, all 60,000 images / 255.
    "fashion-mnist": ((0.2860,) * 3, (0.3530,) * 3),
    # The 50,000 CIFAR-10 training images / 255, per-pixel std over the whole split (the published values;
    # this machine has no copy of CIFAR-10 to recompute them, and 0.2023/0.1994/0.2010 seen elsewhere is wrong).
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
}
DATASET_STATS["synthetic"] = DATASET_STATS["cifar10"]  # CIFAR-10-shaped noise goes through CIFAR-10's pipeline


def to_model_input(images: torch.Tensor, dataset: str, img_size: int) -> torch.Tensor:
    """A batch of stored images (B, 1 or 3, H, W), uint8 or floats in [0, 1], as the model's input on the batch's
    device: floats in [0, 1], resized to `img_size` (bilinear, as torchvision's Resize upsamples), three channels,
    normalised with `dataset`'s statistics. The batch given is left as it was.

    Args:
        images: the batch, on the device that should do the work.
        dataset: whose statistics (a key of DATASET_STATS).
        img_size: the model's input size.
    """
    x = images.float().div_(255) if images.dtype == torch.uint8 else images.float()
    if x.shape[-2:] != (img_size, img_size):
        x = F.interpolate(x, size=(img_size, img_size), mode="bilinear", align_corners=False)
    mean, std = _statistics(dataset, x.device)
    if x.shape[1] == 1 or x is images:  # grayscale (broadcast to RGB), or the caller's own tensor: a new one
        return (x - mean).div_(std)
    # In place otherwise: at the largest batch, one more copy of the input is gigabytes a batch search never held.
    return x.sub_(mean).div_(std)


@lru_cache(maxsize=None)
def _statistics(dataset: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`dataset`'s (mean, std) as (1, 3, 1, 1) tensors on `device`, made once: a tensor built from Python numbers on a
    GPU is a blocking copy, which would make every batch wait until the GPU had finished the steps queued before it."""
    mean, std = (torch.tensor(v, device=device).view(1, 3, 1, 1) for v in DATASET_STATS[dataset])
    return mean, std
