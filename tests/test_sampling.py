"""The one periodic sampler behind the baselines' utilisation, the demo's peers, the GPU proof's NVML series and the
links suite's byte counter."""

import itertools
import threading
import time

from hivetrain.sampling import PeriodicSampler


class Counter(PeriodicSampler):
    def __init__(self, per_tick: int = 1, ready: bool = True):
        super().__init__(0.05, "counter")
        self.ticks, self.per_tick, self.ready = itertools.count(), per_tick, ready

    def before_first(self) -> bool:
        return self.ready

    def sample(self) -> list[int]:
        tick = next(self.ticks)
        return [tick] * self.per_tick


def test_samples_every_interval_until_stopped_and_keeps_each_ticks_samples():
    with Counter(per_tick=2) as counter:
        time.sleep(0.5)
    taken = counter.samples
    assert len(taken) >= 4 and taken[:4] == [0, 0, 1, 1]  # one list per tick, in order
    time.sleep(0.2)
    assert counter.samples == taken and not any(t.name == "counter" for t in threading.enumerate())


def test_nothing_to_sample_starts_no_thread():
    counter = Counter(ready=False).start()
    time.sleep(0.2)
    assert counter.stop() == [] and not any(t.name == "counter" for t in threading.enumerate())
