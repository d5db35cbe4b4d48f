"""The LightningModule every training role shares: cross-entropy classification with top-1/top-5 accuracy, and the
run's optimizer and schedule (hivetrain.optimizer)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torchmetrics.classification import MulticlassAccuracy

from hivetrain.config import RunConfig
from hivetrain.optimizer import make_optimizer


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
