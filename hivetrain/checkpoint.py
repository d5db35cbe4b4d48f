"""Checkpoints: one self-verifying bundle per save, kept in a local folder or an S3 bucket.

A checkpoint is a single uncompressed tar `ckpt-<epoch:06d>.tar` holding
    manifest.json        format, run_id, fingerprint, epoch, and the sha256 + size of each file below
    config.json          the RunConfig, so a checkpoint alone rebuilds its model
    metrics.json         validation metrics at that epoch (epoch, top1, top5, loss, samples, time)
    weights.safetensors  the model's weights (metadata: run_id, fingerprint, epoch)
    optimizer.pt         optimizer and LR-scheduler state dicts (absent when there are none)

The manifest's hashes are the one end-to-end integrity check: every load verifies them, wherever the bundle has been.
One file makes a save atomic everywhere: files.atomic_write locally, a single object in S3. `best.json` beside the
checkpoints names the best one and is replaced the same way once the checkpoint it names is complete.

    store = open_store("s3://bucket/runs/demo")          # or a local folder
    store.save(Checkpoint.from_model(model, config, epoch, metrics, optimizer, scheduler), best=True)
    checkpoint = load_checkpoint("s3://bucket/runs/demo")  # the best one; or a .tar path / s3://.../ckpt-000012.tar
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
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import boto3
import torch
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import ClientError
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
MiB = 1024 * 1024
DEFAULT_STAGING_DIR = Path("~/.cache/hivetrain/checkpoint-staging").expanduser()


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


def _best_record(name: str, top1: float | None) -> bytes:
    return json.dumps(dict(name=name, epoch=epoch_of(name), top1=top1, time=time.time())).encode()


def _best_name(record: bytes | None, where: str) -> str | None:
    try:
        return json.loads(record)["name"] if record is not None else None
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
            atomic_write(self.root / BEST, _best_record(path.name, checkpoint.metrics.get("top1")))
        for name in self._to_delete([p.name for p in self._paths()], self._best()):
            (self.root / name).unlink(missing_ok=True)
        return str(path)

    def _paths(self) -> list[Path]:
        return sorted((p for p in self.root.iterdir() if NAME_RE.match(p.name)), key=lambda p: epoch_of(p.name))

    def _best(self) -> str | None:
        name = _best_name((self.root / BEST).read_bytes() if (self.root / BEST).exists() else None, self.root / BEST)
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


@dataclass(frozen=True)
class S3Options:
    staging_dir: Optional[Path] = None  # local copies until uploaded; None: ~/.cache/hivetrain/checkpoint-staging/...
    multipart_threshold: int = 64 * MiB  # bigger files go up in parts, several at once
    multipart_chunksize: int = 64 * MiB  # S3 wants parts of 5 MiB or more (boto3 raises smaller values to 5 MiB)
    retry_initial: float = 1.0  # seconds before the first background retry; doubles up to retry_max
    retry_max: float = 60.0
    resume_pending: bool = True  # upload what an earlier process left in staging_dir (it exited during an outage)


def parse_s3_uri(uri: str) -> tuple[str, str]:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    if not uri.startswith("s3://") or not bucket:
        raise ValueError(f"{uri!r} is not an s3://bucket/key URI")
    return bucket, key.strip("/")


def _refused(e: Exception) -> bool:
    """S3 answered 4xx (credentials, permissions, a bad request): a retry would not help. Anything else is an outage
    that outlasted botocore's own retries (of dropped connections, timeouts, throttling and 5xx)."""
    if isinstance(e, S3UploadFailedError):
        e = e.__cause__ or e.__context__  # boto3 raises it while handling the ClientError
    return isinstance(e, ClientError) and 400 <= e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) < 500


def _describe(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())  # one line, whatever botocore put in the message


def _float(value: str | None) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class S3CheckpointStore(CheckpointStore):
    """Checkpoints as objects `s3://bucket/prefix/ckpt-<epoch>.tar`, the best named by `prefix/best.json`.

    Credentials come from the standard AWS chain only (env vars, ~/.aws, instance profile). A save writes the bundle to
    a local staging folder, uploads it and deletes the local copy. boto3 does the transfer: multipart above the
    threshold, botocore's standard retries, a CRC32 on every upload request that S3 checks, and one on every
    whole-object download that botocore checks. When S3 stays unreachable the copy stays (a `<name>.best` marker beside
    it if it is to be the best), one warning is logged, and a background thread uploads the queue in order, with
    backoff; `flush` waits for it. A refusal (a 4xx) raises instead.
    """

    def __init__(self, bucket: str, prefix: str = "", endpoint_url: str | None = None, keep_last: int | None = 5,
                 options: S3Options | None = None):
        self.bucket, self.prefix, self.keep_last = bucket, prefix.strip("/"), keep_last
        self.options = options = options or S3Options()
        self.uri = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.staging = Path(options.staging_dir or DEFAULT_STAGING_DIR / bucket / (self.prefix or "_root")).expanduser()
        # A short connect timeout: an outage costs a save seconds, not minutes, before the queue takes over.
        self._s3 = boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=Config(
            connect_timeout=3, read_timeout=30, retries=dict(mode="standard")))
        self._transfer = TransferConfig(multipart_threshold=options.multipart_threshold,
                                        multipart_chunksize=options.multipart_chunksize)
        self._pending: deque[Path] = deque()  # staged copies waiting for S3, oldest first
        self._cond = threading.Condition()
        self._upload_lock = threading.Lock()  # one upload (and its best pointer and pruning) at a time
        self._worker: threading.Thread | None = None
        self._retry_now = self._closed = False  # flush() cuts the worker's backoff short
        if options.resume_pending and self.staging.is_dir():
            with self._cond:
                self._pending.extend(sorted(p for p in self.staging.iterdir() if NAME_RE.match(p.name)))
                self._start_worker()

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}".lstrip("/")

    def _name(self, uri: str) -> str:
        bucket, key = parse_s3_uri(uri)
        name = key.rpartition("/")[2]
        if bucket != self.bucket or key != self._key(name) or not NAME_RE.match(name):
            raise CheckpointNotFound(f"{uri} is not a checkpoint of {self.uri}")
        return name

    @staticmethod
    def _marker(path: Path) -> Path:
        return path.with_name(path.name + ".best")  # survives a restart, so a resumed upload still becomes the best

    def _staged(self) -> list[Path]:
        with self._cond:
            return list(self._pending)

    def save(self, checkpoint: Checkpoint, best: bool = False) -> str:
        if self._closed:
            raise CheckpointError(f"{self.uri}: the store is closed")
        path = write_checkpoint(checkpoint, self.staging / checkpoint_name(checkpoint.epoch))
        if best:
            atomic_write(self._marker(path), b"")
        with self._cond:
            queued = bool(self._pending)
            if queued:  # S3 is away: queue behind the others, in order, without waiting for a timeout
                self._pending.append(path)
                self._start_worker()
        if queued:
            return f"{self.uri}/{path.name}"
        try:
            self._upload(path)
        except Exception as e:
            if _refused(e):
                raise CheckpointError(f"S3 refused {self.uri}/{path.name} ({_describe(e)}); "
                                      f"the local copy stays at {path}") from e
            # Only an empty queue gets here, so this is a new outage: its one warning. Saves during it queue above.
            logger.warning(f"S3 unreachable, keeping the local copy at {path}, retrying in the background "
                           f"({_describe(e)})")
            with self._cond:
                self._pending.append(path)
                self._start_worker()
        return f"{self.uri}/{path.name}"

    def _upload(self, path: Path) -> None:
        with self._upload_lock:
            try:
                before = path.stat()
            except FileNotFoundError:  # the same epoch was queued twice and an earlier upload sent this file already
                return
            metrics = peek_metrics(path)
            # Listing shows top1 and time from these without downloading the object. Values must be ASCII.
            metadata = {k: repr(float(v)) for k, v in metrics.items() if k in ("top1", "time") and v is not None}
            self._s3.upload_file(str(path), self.bucket, self._key(path.name), Config=self._transfer, ExtraArgs=dict(
                Metadata=metadata, ChecksumAlgorithm="CRC32", ContentType="application/x-tar"))
            if self._marker(path).exists():
                self._s3.put_object(Bucket=self.bucket, Key=self._key(BEST), ContentType="application/json",
                                    Body=_best_record(path.name, metrics.get("top1")), ChecksumAlgorithm="CRC32")
            for name in self._to_delete(list(self._objects()), self._best()):
                self._s3.delete_object(Bucket=self.bucket, Key=self._key(name))
            after = path.stat()
            if (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns):
                path.unlink()  # else a newer save of this epoch replaced it meanwhile: its own queued item sends it
                self._marker(path).unlink(missing_ok=True)

    def _start_worker(self) -> None:  # with self._cond held
        if self._worker is None and self._pending and not self._closed:
            self._worker = threading.Thread(target=self._drain, name="checkpoint-upload", daemon=True)
            self._worker.start()

    def _drain(self) -> None:
        delay, refusals = self.options.retry_initial, set()
        while True:
            with self._cond:
                if self._closed or not self._pending:
                    self._worker = None
                    self._cond.notify_all()
                    return
                path = self._pending[0]  # stays queued while uploading, so new saves queue behind it
            try:
                self._upload(path)
            except Exception as e:
                if _refused(e) and str(e) not in refusals:  # e.g. credentials revoked: say so once, keep trying
                    refusals.add(str(e))
                    logger.error(f"Uploading {path} to {self.uri} failed ({_describe(e)}); retrying")
                with self._cond:
                    kicked = self._cond.wait_for(lambda: self._closed or self._retry_now, timeout=delay)
                    self._retry_now = False
                # after a flush() the backoff starts over: S3 is likely back and someone is waiting for it
                delay = self.options.retry_initial if kicked else min(delay * 2, self.options.retry_max)
                continue
            delay = self.options.retry_initial
            with self._cond:
                self._pending.popleft()
                if not self._pending:  # info, not a second warning: the outage's one warning said it would retry
                    logger.info(f"S3 is back: the staged checkpoints are uploaded to {self.uri}")
                self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        with self._cond:
            self._retry_now = True  # S3 may be back already: do not sit out the rest of a long backoff
            self._start_worker()
            self._cond.notify_all()
            return self._cond.wait_for(lambda: not self._pending or self._closed, timeout=timeout) and not self._pending

    def close(self) -> None:
        """Stop retrying. Checkpoints not uploaded yet stay in the staging folder for the next store on it."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            worker = self._worker
        if worker is not None:
            worker.join()  # at most the upload in progress

    def _best(self) -> str | None:
        if staged := [p for p in self._staged() if self._marker(p).exists()]:  # the newest best still waits for S3
            return staged[-1].name
        try:
            return _best_name(self._s3.get_object(Bucket=self.bucket, Key=self._key(BEST))["Body"].read(), BEST)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise

    def best_uri(self) -> str | None:
        return f"{self.uri}/{name}" if (name := self._best()) else None

    def _objects(self) -> dict[str, int]:
        """Checkpoint names directly under the prefix, with their sizes."""
        pages = self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key(""),
                                                                        Delimiter="/")
        objects = {obj["Key"].removeprefix(self._key("")): obj["Size"] for p in pages for obj in p.get("Contents", [])}
        return {name: size for name, size in objects.items() if NAME_RE.match(name)}

    def list(self) -> list[CheckpointEntry]:
        best, entries = self._best(), []
        for name, size in self._objects().items():
            meta = self._s3.head_object(Bucket=self.bucket, Key=self._key(name))["Metadata"]
            entries.append(CheckpointEntry(f"{self.uri}/{name}", name, epoch_of(name), size, _float(meta.get("top1")),
                                           _float(meta.get("time")), name == best))
        return sorted(entries, key=lambda e: e.epoch)

    def _load(self, uri: str) -> Checkpoint:
        name = self._name(uri)
        if staged := [p for p in self._staged() if p.name == name]:  # not uploaded yet: the local copy is it
            return read_checkpoint(staged[0], label=uri)
        with tempfile.TemporaryDirectory(prefix="hivetrain-ckpt-") as tmp:
            try:  # ChecksumMode: botocore checks a whole-object GET against the CRC32 S3 stored
                self._s3.download_file(self.bucket, self._key(name), f"{tmp}/{name}", Config=self._transfer,
                                       ExtraArgs=dict(ChecksumMode="ENABLED"))
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                    raise CheckpointNotFound(f"checkpoint {uri} does not exist") from None
                raise
            return read_checkpoint(f"{tmp}/{name}", label=uri)


def open_store(uri_or_path: str | Path, keep_last: int | None = 5, endpoint_url: str | None = None,
               options: S3Options | None = None) -> CheckpointStore:
    """A store on a local folder or on `s3://bucket/prefix`."""
    if str(uri_or_path).startswith("s3://"):
        bucket, prefix = parse_s3_uri(str(uri_or_path))
        return S3CheckpointStore(bucket, prefix, endpoint_url=endpoint_url, keep_last=keep_last, options=options)
    return LocalCheckpointStore(uri_or_path, keep_last=keep_last)


def load_checkpoint(uri_or_path: str | Path, endpoint_url: str | None = None) -> Checkpoint:
    """Load and verify one checkpoint: a .tar path or s3://bucket/.../ckpt-N.tar; a folder or s3://bucket/prefix
    loads that store's best checkpoint (else its newest)."""
    text = str(uri_or_path)
    if text.startswith("s3://"):
        bucket, key = parse_s3_uri(text)
        is_object = NAME_RE.match(key.rpartition("/")[2]) is not None
        # Reading only: leave whatever a running coordinator staged on this machine to that coordinator.
        with S3CheckpointStore(bucket, key.rpartition("/")[0] if is_object else key, endpoint_url, keep_last=None,
                               options=S3Options(resume_pending=False)) as store:
            return store.load(text if is_object else None)
    path = Path(text).expanduser()
    return LocalCheckpointStore(path, keep_last=None).load() if path.is_dir() else read_checkpoint(path)
