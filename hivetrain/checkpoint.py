"""Checkpoints: one self-verifying bundle per save, kept in a local folder (here) or an S3 bucket (hivetrain.s3_store);
hivetrain.checkpoint_location opens either from a path or an s3:// URI.

A checkpoint is a single uncompressed tar `ckpt-<epoch:06d>.tar` holding
    manifest.json        format, run_id, fingerprint, epoch, and the sha256 + size of each file below
    config.json          the RunConfig, so a checkpoint alone rebuilds its model
    metrics.json         validation metrics at that epoch (epoch, top1, top5, loss, samples, time)
    weights.safetensors  the model's weights (metadata: run_id, fingerprint, epoch)
    optimizer.pt         optimizer and LR-scheduler state dicts (absent when there are none)

The manifest's hashes are the one end-to-end integrity check: every load verifies them, wherever the bundle has been.
One file makes a save atomic everywhere: files.atomic_write locally, a single object in S3. `best.json` beside the
checkpoints names the best one and is replaced the same way once the checkpoint it names is complete.

    store = LocalCheckpointStore("runs/demo/checkpoints")
    store.save(Checkpoint.from_model(model, config, epoch, metrics, optimizer, scheduler), best=True)
    checkpoint = store.load()  # the best one
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import pickle
import re
import struct
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from hivetrain.config import RunConfig
from hivetrain.files import atomic_write

logger = logging.getLogger(__name__)

FORMAT = "hivetrain-checkpoint/1"
MANIFEST, CONFIG, METRICS, WEIGHTS, OPTIMIZER = (
    "manifest.json", "config.json", "metrics.json", "weights.safetensors", "optimizer.pt")
BEST = "best.json"
NAME_RE = re.compile(r"^ckpt-(\d{6,})\.tar$")


class CheckpointError(RuntimeError):
    """A checkpoint problem a user can act on; its message is meant to be shown as it is."""


class CheckpointNotFound(CheckpointError):
    pass


class CheckpointCorrupted(CheckpointError):
    pass


def checkpoint_name(epoch: int) -> str:
    return f"ckpt-{epoch:06d}.tar"


def epoch_of(name: str) -> int:
    return int(NAME_RE.match(name).group(1))


@dataclass
class Checkpoint:
    config: RunConfig
    epoch: int
    weights: dict[str, torch.Tensor]
    metrics: dict[str, Any] = field(default_factory=dict)
    optimizer: Optional[dict[str, Any]] = None  # optimizer.state_dict()
    scheduler: Optional[dict[str, Any]] = None  # lr_scheduler.state_dict()

    @classmethod
    def from_model(cls, model: torch.nn.Module, config: RunConfig, epoch: int, metrics: dict[str, Any] | None = None,
                   optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None) -> Checkpoint:
        """`model` is the timm model itself (not a Lightning wrapper), so the keys match `create_model`'s."""
        # References, not copies: stores serialise the checkpoint before save() returns, so training may go on after.
        weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
        return cls(config, epoch, weights, dict(metrics or {}),
                   optimizer.state_dict() if optimizer is not None else None,
                   scheduler.state_dict() if scheduler is not None else None)

    def build_model(self) -> torch.nn.Module:
        from hivetrain.model import create_model  # lazy: timm is slow to import and listing never needs it

        # The architecture only: the checkpoint's weights replace pretrained ones, which would need the hub.
        model = create_model(dataclasses.replace(self.config.model, pretrained=False), seed=self.config.seed)
        model.load_state_dict(self.weights)
        return model


def write_checkpoint(checkpoint: Checkpoint, path: str | Path) -> Path:
    config, epoch = checkpoint.config, checkpoint.epoch
    metrics = {"time": time.time(), **checkpoint.metrics, "epoch": epoch}
    members = {CONFIG: config.to_json().encode(), METRICS: json.dumps(metrics, sort_keys=True).encode(),
               WEIGHTS: save_safetensors(checkpoint.weights, metadata=dict(
                   run_id=config.run_id, fingerprint=config.fingerprint, epoch=str(epoch)))}
    if checkpoint.optimizer is not None or checkpoint.scheduler is not None:
        buffer = io.BytesIO()
        torch.save(dict(optimizer=checkpoint.optimizer, scheduler=checkpoint.scheduler), buffer)
        members[OPTIMIZER] = buffer.getvalue()
    files = {name: dict(size=len(data), sha256=hashlib.sha256(data).hexdigest()) for name, data in members.items()}
    manifest = dict(format=FORMAT, run_id=config.run_id, fingerprint=config.fingerprint, epoch=epoch, files=files)

    def write_tar(f) -> None:
        # The manifest and the small files first, cheap to peek at. No user names (tar's defaults): buckets are shared.
        with tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for name, data in {MANIFEST: json.dumps(manifest, indent=1).encode(), **members}.items():
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(data), int(time.time())
                tar.addfile(info, io.BytesIO(data))

    return atomic_write(path, write_tar)


def _member(tar: tarfile.TarFile, name: str) -> bytes:
    try:
        f = tar.extractfile(tar.getmember(name))
    except KeyError:
        raise CheckpointCorrupted(f"has no {name}") from None
    if f is None:
        raise CheckpointCorrupted(f"{name} is not a regular file")
    return f.read()


def read_checkpoint(path: str | Path, label: str | None = None) -> Checkpoint:
    """Load a bundle after checking every file against its manifest; `label` names it in errors (e.g. its S3 URI)."""
    label = label or str(path)
    if not Path(path).is_file():
        raise CheckpointNotFound(f"checkpoint {label} does not exist")
    try:
        # One open file throughout: a concurrent os.replace of the same name cannot mix two checkpoints.
        with tarfile.open(path, mode="r:") as tar:
            manifest = json.loads(_member(tar, MANIFEST))
            if manifest.get("format") != FORMAT:
                raise CheckpointCorrupted(f"format {manifest.get('format')!r} is not {FORMAT!r}")
            data = {name: _member(tar, name) for name in (CONFIG, METRICS, WEIGHTS, *manifest["files"])}
        for name, content in data.items():
            expected = manifest["files"].get(name)
            if expected is None:
                raise CheckpointCorrupted(f"its manifest lists no {name}")
            if len(content) != expected["size"]:
                raise CheckpointCorrupted(f"{name} has {len(content)} bytes, its manifest says {expected['size']}")
            if hashlib.sha256(content).hexdigest() != expected["sha256"]:
                raise CheckpointCorrupted(f"{name} does not match its sha256 in the manifest")
        config, metrics = RunConfig.from_json(data[CONFIG].decode()), json.loads(data[METRICS])
        # safetensors starts with an 8-byte little-endian header length, then a JSON header holding "__metadata__"
        meta = json.loads(data[WEIGHTS][8:8 + struct.unpack("<Q", data[WEIGHTS][:8])[0]]).get("__metadata__") or {}
        weights = load_safetensors(data.pop(WEIGHTS))
        # weights_only: a checkpoint may come from a shared bucket, and full unpickling would run its code.
        state = torch.load(io.BytesIO(data[OPTIMIZER]), map_location="cpu", weights_only=True) if OPTIMIZER in data \
            else {}
    except CheckpointCorrupted as e:
        raise CheckpointCorrupted(f"checkpoint {label} is corrupted: {e}") from None
    except (tarfile.TarError, EOFError, ValueError, KeyError, TypeError, AttributeError, struct.error, SafetensorError,
            pickle.UnpicklingError) as e:
        # tarfile reports a truncated file as ReadError("unexpected end of data") or a bad header; JSON as ValueError.
        raise CheckpointCorrupted(f"checkpoint {label} is truncated or corrupted: {type(e).__name__}: {e}") from None
    epochs = {str(manifest.get("epoch")), str(metrics.get("epoch")), str(meta.get("epoch"))}
    if meta.get("fingerprint") != config.fingerprint or len(epochs) != 1:
        raise CheckpointCorrupted(
            f"checkpoint {label} mixes runs or epochs: weights of fingerprint {meta.get('fingerprint')} epoch "
            f"{meta.get('epoch')}, config fingerprint {config.fingerprint}, epochs {sorted(epochs)}")
    return Checkpoint(config, int(manifest["epoch"]), weights, metrics, state.get("optimizer"), state.get("scheduler"))


def peek_metrics(path: Path) -> dict[str, Any]:
    """metrics.json of a bundle without verifying it (for listings); empty when it is unreadable."""
    try:
        with tarfile.open(path, mode="r:") as tar:
            return json.loads(_member(tar, METRICS))
    except (OSError, tarfile.TarError, EOFError, ValueError, CheckpointCorrupted):
        return {}


# ---------------------------------------------------------------------------------------------------------------------
# Stores: save(checkpoint, best) -> URI, best_uri(), list() oldest first, load(uri or the best), flush(), close()


@dataclass(frozen=True)
class CheckpointEntry:
    uri: str
    name: str
    epoch: int
    size: int
    top1: Optional[float]
    time: Optional[float]  # unix time the checkpoint was made
    is_best: bool


class CheckpointStore:
    """Keeps the newest `keep_last` checkpoints (None: all) plus the best one."""

    uri: str
    keep_last: Optional[int]

    def load(self, uri: str | None = None) -> Checkpoint:
        """A checkpoint by URI; without one, the best, else the newest."""
        uri = uri or self.best_uri() or next((entry.uri for entry in reversed(self.list())), None)
        if uri is None:
            raise CheckpointNotFound(f"no checkpoints in {self.uri}")
        return self._load(uri)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for pending uploads; True when nothing is pending. Local stores never have any."""
        return True

    def close(self) -> None:
        pass

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _to_delete(self, names: list[str], best: str | None) -> list[str]:
        ordered = sorted(names, key=epoch_of)
        old = ordered[:max(len(ordered) - self.keep_last, 0)] if self.keep_last is not None else []
        return [name for name in old if name != best]


def best_marker(name: str, top1: float | None) -> bytes:
    """The contents of a store's best marker (BEST), naming checkpoint `name`."""
    return json.dumps(dict(name=name, epoch=epoch_of(name), top1=top1, time=time.time())).encode()


def best_name(marker: bytes | None, where: str) -> str | None:
    """The checkpoint a best marker names, or None (no marker; an unreadable one is ignored with a warning)."""
    try:
        return json.loads(marker)["name"] if marker is not None else None
    except (ValueError, KeyError, TypeError) as e:
        logger.warning(f"Ignoring an unreadable {where}: {e}")
        return None


class LocalCheckpointStore(CheckpointStore):
    def __init__(self, root: str | Path, keep_last: int | None = 5):
        self.root = Path(root).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)
        self.uri, self.keep_last = str(self.root), keep_last

    def save(self, checkpoint: Checkpoint, best: bool = False) -> str:
        path = write_checkpoint(checkpoint, self.root / checkpoint_name(checkpoint.epoch))
        if best:
            atomic_write(self.root / BEST, best_marker(path.name, checkpoint.metrics.get("top1")))
        for name in self._to_delete([p.name for p in self._paths()], self._best()):
            (self.root / name).unlink(missing_ok=True)
        return str(path)

    def _paths(self) -> list[Path]:
        return sorted((p for p in self.root.iterdir() if NAME_RE.match(p.name)), key=lambda p: epoch_of(p.name))

    def _best(self) -> str | None:
        name = best_name((self.root / BEST).read_bytes() if (self.root / BEST).exists() else None, self.root / BEST)
        return name if isinstance(name, str) and NAME_RE.match(name) and (self.root / name).is_file() else None

    def best_uri(self) -> str | None:
        return str(self.root / name) if (name := self._best()) else None

    def list(self) -> list[CheckpointEntry]:
        best = self._best()
        return [CheckpointEntry(str(p), p.name, epoch_of(p.name), p.stat().st_size, metrics.get("top1"),
                                metrics.get("time"), p.name == best)
                for p in self._paths() if (metrics := peek_metrics(p))]  # {}: pruned by a concurrent save

    def _load(self, uri: str) -> Checkpoint:
        return read_checkpoint(uri)
