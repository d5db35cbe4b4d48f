"""What a role writes when asked (`--events PATH`): one JSON object per line for each thing that happened, with its
name and unix time. Benchmarks, the demo and tests read these figures instead of the console's wording, which is for
people and may change."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Optional


class EventLog:
    """Appends events to `path`, each flushed as it happens; with no path it writes nothing. Thread-safe: the
    coordinator's monitor loop and its validator both write."""

    def __init__(self, path: Optional[str | Path]):
        self._file = None if path is None else Path(path).open("a")
        self._lock = threading.Lock()

    def __call__(self, event: str, **fields) -> None:
        if self._file is None:
            return
        line = json.dumps(dict(event=event, time=time.time(), **fields))
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()
