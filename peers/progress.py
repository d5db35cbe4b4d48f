"""What a peer shows while it trains: one line per swarm epoch, and the stop-at-epoch rule."""

from __future__ import annotations

import hashlib
import time
from typing import Any, Optional

import lightning.pytorch as pl
import torch


class SwarmProgress(pl.Callback):
    def __init__(self, batch_size: int, target_batch_size: int, stop_at_epoch: Optional[int] = None,
                 min_peers: int = 1):
        self.batch_size, self.target_batch_size, self.stop_at_epoch = batch_size, target_batch_size, stop_at_epoch
        self.min_peers = min_peers
        self.epoch = 0
        self.samples = 0  # samples this peer contributed
        self._epoch_started = time.monotonic()
        self._losses: list[float] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._wait_for_peers(trainer)
        self.epoch = trainer.strategy.local_epoch  # after the state download: a late joiner starts where the swarm is
        self._epoch_started = time.monotonic()
        print(f"Starting at swarm epoch {self.epoch} | params {parameter_digest(pl_module)}", flush=True)
        self._maybe_stop(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.samples += self.batch_size
        if isinstance(outputs, dict) and "loss" in outputs:
            self._losses.append(float(outputs["loss"]))
        epoch = trainer.strategy.local_epoch
        if epoch != self.epoch:
            now = time.monotonic()
            throughput = self.target_batch_size * (epoch - self.epoch) / max(now - self._epoch_started, 1e-6)
            loss = sum(self._losses) / len(self._losses) if self._losses else float("nan")
            line = (f"swarm epoch {epoch} | {max(1, trainer.strategy.num_peers)} peer(s) | {throughput:.0f} samples/s"
                    f" | this peer: {self.samples} samples, loss {loss:.3f} | params {parameter_digest(pl_module)}")
            bar = trainer.progress_bar_callback
            bar.print(line) if bar is not None else print(line, flush=True)
            self.epoch, self._epoch_started, self._losses = epoch, now, []
        self._maybe_stop(trainer)

    def _wait_for_peers(self, trainer: pl.Trainer) -> None:
        """A peer alone takes whole swarm epochs by itself, at full local speed: with --min-peers it waits for others
        to join before its first step."""
        waited = 0.0
        while (present := trainer.strategy.count_reachable_peers()) < self.min_peers:
            if waited % 10 == 0:
                print(f"Waiting for peers: {present} of {self.min_peers} in the swarm", flush=True)
            time.sleep(0.5)
            waited += 0.5
        if waited:
            trainer.strategy.optimizer.load_state_from_peers()  # whoever was first may have stepped meanwhile

    def _maybe_stop(self, trainer: pl.Trainer) -> None:
        if self.stop_at_epoch is not None and trainer.strategy.local_epoch >= self.stop_at_epoch:
            trainer.should_stop = True


def parameter_digest(module: torch.nn.Module) -> str:
    """A short hash of the parameters: peers in sync show the same digest at the same swarm epoch."""
    digest = hashlib.sha256()
    for param in module.parameters():
        digest.update(param.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:10]
