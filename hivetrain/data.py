"""The run's datasets (hivetrain.datasets) as one LightningDataModule, for training: the peers and the baselines.

Every image reaches the model as a normalised float tensor (3, img_size, img_size) and every label as int64: made per
sample on the CPU, or, with `device_transforms` (peers), per batch on the training device from the stored pixels
(hivetrain.pixels).
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Dataset

from hivetrain.config import RunConfig
from hivetrain.datasets import data_root, load_splits, prepare_dataset
from hivetrain.pixels import to_model_input


class ImageDataModule(L.LightningDataModule):
    def __init__(self, config: RunConfig, data_dir: Path, batch_size: int, seed: int, num_workers: int,
                 val_limit: int | None, pin_memory: bool = False, device_transforms: bool = False):
        """Args:
            config: the run; its dataset, image size and augmentation shape the data.
            data_dir: where the dataset's files are (or are downloaded to).
            batch_size: samples per batch of both loaders.
            seed: the training loader's shuffling seed (per peer: peers see different orders).
            num_workers: DataLoader worker processes.
            val_limit: validate on the first N validation samples only (None: all).
            pin_memory: batches in page-locked memory, for asynchronous copies to a CUDA device (Lightning copies
                with non_blocking=True to every device but the CPU).
            device_transforms: the loaders give the stored images (uint8 at their own size, augmented there), and
                on_after_batch_transfer scales, resizes and normalises each batch on the training device, so a GPU
                is not held back by per-sample resizing on a few CPU cores (hivetrain.pixels). Only where Lightning
                moves the batches (fit, validate); other loops get ready inputs from the loaders without it.
        """
        super().__init__()
        self.config, self.data_dir, self.batch_size = config, data_dir, batch_size
        self.seed, self.num_workers, self.val_limit, self.pin_memory = seed, num_workers, val_limit, pin_memory
        self.device_transforms = device_transforms
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.num_train = self.num_val = 0

    def prepare_data(self) -> None:
        prepare_dataset(self.config, self.data_dir)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:  # Lightning calls setup per stage; load once
            return
        self.train_set, self.val_set = load_splits(self.config, self.data_dir, self.device_transforms, self.val_limit)
        self.num_train, self.num_val = len(self.train_set), len(self.val_set)

    def on_after_batch_transfer(self, batch: tuple[torch.Tensor, torch.Tensor], dataloader_idx: int
                                ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.device_transforms:
            return batch
        images, labels = batch
        return to_model_input(images, self.config.data.dataset, self.config.model.img_size), labels

    def train_dataloader(self) -> DataLoader:
        self.setup()
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True,  # fixed per-step batch
            generator=torch.Generator().manual_seed(self.seed),  # per-peer seed: peers see different orders
            num_workers=self.num_workers, persistent_workers=self.num_workers > 0, pin_memory=self.pin_memory,
        )

    def val_dataloader(self) -> DataLoader:
        self.setup()
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0, pin_memory=self.pin_memory)


def make_datamodule(config: RunConfig, data_dir: str | Path | None = None, batch_size: int | None = None,
                    seed: int = 0, num_workers: int = 0, val_limit: int | None = None,
                    pin_memory: bool = False, device_transforms: bool = False) -> ImageDataModule:
    """The run's data module (ImageDataModule's arguments); data_dir None: hivetrain.datasets.DEFAULT_DATA_DIR,
    batch_size None: the run's."""
    return ImageDataModule(config, data_root(data_dir), batch_size or config.batch_size, seed, num_workers, val_limit,
                           pin_memory, device_transforms)
