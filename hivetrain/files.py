"""Writing a file so that a reader sees the old content or the new, never half of either."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import BinaryIO, Callable


def atomic_write(path: str | Path, data: bytes | str | Callable[[BinaryIO], None], mode: int = 0o666) -> Path:
    """Write `data` (bytes, text, or a function that writes to the open binary file) to a hidden temporary file beside
    `path`, fsync it, then os.replace it onto `path`: a crash leaves the old file or the new one, never a hole.
    `mode` is the new file's permissions before the umask (0o600 for a secret)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Unique (concurrent writers of one name) and in the same folder: os.replace is atomic only within a file system.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the name is
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
