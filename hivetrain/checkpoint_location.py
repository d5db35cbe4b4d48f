"""Where checkpoints live: a local folder or `s3://bucket/prefix`. open_store and load_checkpoint pick the store
(hivetrain.checkpoint's LocalCheckpointStore, or hivetrain.s3_store's, which only S3 users import: the `coordinator`
extra brings boto3).

    store = open_store("s3://bucket/runs/demo")          # or a local folder
    store.save(Checkpoint.from_model(model, config, epoch, metrics, optimizer, scheduler), best=True)
    checkpoint = load_checkpoint("s3://bucket/runs/demo")  # the best one; or a .tar path / s3://.../ckpt-000012.tar
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hivetrain.checkpoint import NAME_RE, Checkpoint, CheckpointStore, LocalCheckpointStore, read_checkpoint


def open_store(uri_or_path: str | Path, keep_last: int | None = 5, endpoint_url: str | None = None,
               options: Any = None) -> CheckpointStore:
    """A store on a local folder or on `s3://bucket/prefix` (hivetrain.s3_store; `options`: its S3Options)."""
    if str(uri_or_path).startswith("s3://"):
        from hivetrain.s3_store import S3CheckpointStore, parse_s3_uri

        bucket, prefix = parse_s3_uri(str(uri_or_path))
        return S3CheckpointStore(bucket, prefix, endpoint_url=endpoint_url, keep_last=keep_last, options=options)
    return LocalCheckpointStore(uri_or_path, keep_last=keep_last)


def load_checkpoint(uri_or_path: str | Path, endpoint_url: str | None = None) -> Checkpoint:
    """Load and verify one checkpoint: a .tar path or s3://bucket/.../ckpt-N.tar; a folder or s3://bucket/prefix
    loads that store's best checkpoint (else its newest)."""
    text = str(uri_or_path)
    if text.startswith("s3://"):
        from hivetrain.s3_store import S3CheckpointStore, S3Options, parse_s3_uri

        bucket, key = parse_s3_uri(text)
        is_object = NAME_RE.match(key.rpartition("/")[2]) is not None
        # Reading only: leave whatever a running coordinator staged on this machine to that coordinator.
        with S3CheckpointStore(bucket, key.rpartition("/")[0] if is_object else key, endpoint_url, keep_last=None,
                               options=S3Options(resume_pending=False)) as store:
            return store.load(text if is_object else None)
    path = Path(text).expanduser()
    return LocalCheckpointStore(path, keep_last=None).load() if path.is_dir() else read_checkpoint(path)
