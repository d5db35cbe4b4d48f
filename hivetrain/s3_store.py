"""Checkpoints in an S3 bucket (hivetrain.checkpoint's bundles, as objects): boto3 does the transfer, its retries and
checksums; this adds the durable upload queue that outlives an outage, the best marker and pruning. Only the
coordinator and tools that read S3 checkpoints import it (the `coordinator` extra brings boto3).

    store = open_store("s3://bucket/runs/demo")   # hivetrain.checkpoint_location.open_store
"""

from __future__ import annotations

import logging
import tempfile
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import boto3
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import ClientError

from hivetrain.checkpoint import (BEST, NAME_RE, Checkpoint, CheckpointEntry, CheckpointError, CheckpointNotFound,
                                  CheckpointStore, best_name, best_marker, checkpoint_name, epoch_of, peek_metrics,
                                  read_checkpoint, write_checkpoint)
from hivetrain.files import atomic_write

logger = logging.getLogger(__name__)

MiB = 1024 * 1024
DEFAULT_STAGING_DIR = Path("~/.cache/hivetrain/checkpoint-staging").expanduser()


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
                                    Body=best_marker(path.name, metrics.get("top1")), ChecksumAlgorithm="CRC32")
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
            return best_name(self._s3.get_object(Bucket=self.bucket, Key=self._key(BEST))["Body"].read(), BEST)
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
