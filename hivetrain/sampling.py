"""A measurement taken every few seconds in a thread of its own while something runs: the one loop behind the
baselines' utilisation samples, the demo's per-peer CPU and memory, the GPU proof's NVML series and the links suite's
byte counter."""

from __future__ import annotations

import threading
from typing import Any, Iterable


class PeriodicSampler:
    """A daemon thread that calls `sample()` every `interval` seconds between `start()` and `stop()`, and keeps what
    each call returns (an iterable of samples: none, one, or one per device). Usable as a context manager.

    Args:
        interval: seconds between two samples.
        name: the thread's name.
    """

    def __init__(self, interval: float, name: str):
        self.interval, self.name = interval, name
        self.samples: list[Any] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> Iterable[Any]:
        """The samples of one tick."""
        raise NotImplementedError

    def before_first(self) -> bool:
        """Called by start() before the thread: set reference points. False: nothing to sample (the thread is not
        started, and stop() returns no samples)."""
        return True

    def start(self) -> PeriodicSampler:
        if self.before_first():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        return self

    def stop(self) -> list[Any]:
        """Stop sampling (the tick in progress finishes first); every sample taken."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        return self.samples

    def __enter__(self) -> PeriodicSampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.extend(self.sample())
