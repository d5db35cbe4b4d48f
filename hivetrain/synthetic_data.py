"""Synthetic data shaped like CIFAR-10: seeded random uint8 images (3 x 32 x 32) and labels (10 classes), each made
when it is asked for, so a 50,000-image set takes no memory. The GPU proof trains on it, and so does the "synthetic"
dataset of hivetrain.data (the synthetic-vit-b32 preset: the mission's shape on machines that cannot download).

Sample i of a split is a function of (seed, split, i) alone: the same seed gives the same images in any order and in
any DataLoader worker. They are noise, so a model learns nothing from them and they say nothing about accuracy; what
they exercise is exactly the GPU work of ViT-B/32 at 224 px. The GPU proof resizes and normalises whole batches on
the device (hivetrain.pixels.to_model_input), as the "synthetic" dataset of hivetrain.data does with
device_transforms, through CIFAR-10's statistics.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

DATA_ORIGIN = "synthetic, seeded random images shaped like CIFAR-10"  # stated on every GPU page
TRAIN_SAMPLES, VAL_SAMPLES = 50_000, 10_000  # CIFAR-10's split sizes, for the "synthetic" dataset
IMAGE_SHAPE = (3, 32, 32)  # CHW, as hivetrain.data holds CIFAR-10
NUM_CLASSES = 10
SPLITS = {"train": 0, "val": 1}  # part of each sample's seed: the two splits never share an image


class SyntheticCifar10(Dataset):
    """`num_samples` images of `IMAGE_SHAPE` (uint8) with labels in [0, 10) (int64)."""

    def __init__(self, num_samples: int, seed: int, split: str = "train"):
        if num_samples < 1:
            raise ValueError(f"a synthetic split needs at least 1 sample, not {num_samples}")
        if seed < 0:
            raise ValueError(f"the seed must be 0 or more, not {seed}")
        if split not in SPLITS:
            raise ValueError(f"split {split!r} is not one of {', '.join(SPLITS)}")
        self.num_samples, self.seed, self.split = num_samples, seed, split

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} of a split of {self.num_samples}")
        rng = np.random.default_rng((self.seed, SPLITS[self.split], index))
        image = rng.integers(0, 256, size=IMAGE_SHAPE, dtype=np.uint8)
        label = rng.integers(0, NUM_CLASSES)
        return torch.from_numpy(image), torch.tensor(label, dtype=torch.int64)
