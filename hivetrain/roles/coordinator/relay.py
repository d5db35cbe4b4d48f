"""The coordinator's part in the outer rounds of peers that nobody can dial.

hivemind's averager joins only groups that a dialable peer leads: a peer behind NAT averages in client mode, as a
follower. In a diloco swarm of such peers alone (friends on Colab and Kaggle, home machines) nobody leads, every
round finds no group, and each peer only ever takes its own outer steps. So while every trainer in the progress
records is in client mode, the coordinator's outer-state averager (the state holder's, on the same prefix) takes part
in each round as hivemind's auxiliary peer: it leads the group and reduces every part of the all-reduce, with no
weight and no tensors of its own, the run's robust aggregation applied as on any reducer. It gathers RELAY_GATHER,
which the peers do not count as a groupmate (OuterState).

Its search for the group starts when the round comes due by the records, as the peers' own do, and lasts the run's
matchmaking time: the peers that notice the round within it average together. Rounds paced in seconds fall due on
the clock's grid (hivetrain.diloco.next_round_time): its group forms when theirs does (group_time).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

import psutil
from hivemind.optim.progress_tracker import LocalTrainingProgress

from hivetrain.diloco import group_time, next_round_time
from hivetrain.events import EventLog
from hivetrain.outer_state import RELAY_GATHER, OuterState
from hivetrain.swarm import read_records

logger = logging.getLogger(__name__)

LOOK_EVERY = 0.25  # seconds between two reads of the progress records while relaying and no round is due
IDLE_LOOK_EVERY = 2.0  # ...while a trainer that can be dialled leads the rounds (each read parses every record)


def print_flushed(line: str) -> None:
    print(line, flush=True)


class RoundRelay:
    """Leads the outer rounds of a swarm whose trainers are all in client mode, in a thread of its own.

    Args:
        outer: the coordinator's OuterState, created auxiliary (it contributes nothing to a round).
        progress_key: the DHT key of the peers' progress records (the round tracker's).
        samples_per_peer: H inner steps of the run's batch: a round is due once the records' samples for it reach
            this many per trainer, as the peers' RoundTracker counts.
        averaging_timeout: seconds to look for the round's group before the round is left to the peers alone.
        robust: the run aggregates robustly, so its groups hold peers of one round only (OuterState's group bits).
        round_seconds: the run's rounds paced in seconds (None: by samples, `samples_per_peer`).
        matchmaking_time: how long ahead of a round paced in seconds its search for the group starts.
        events: where each relayed round is told (`relayed`).
        report: the coordinator's console, told when relaying starts and stops.
    """

    def __init__(self, outer: OuterState, progress_key: str, samples_per_peer: int, averaging_timeout: float,
                 robust: bool, events: EventLog = EventLog(None), report: Callable[[str], None] = print_flushed,
                 round_seconds: Optional[float] = None, matchmaking_time: float = 0.0):
        self.outer, self.progress_key, self.samples_per_peer = outer, progress_key, samples_per_peer
        self.round_seconds, self.matchmaking_time = round_seconds, matchmaking_time
        self._last_time: Optional[float] = None  # rounds paced in seconds: the grid time last relayed (or tried)
        self.averaging_timeout, self.robust, self.events, self.report = averaging_timeout, robust, events, report
        self._relaying = False  # the last look found only peers in client mode
        self._last_round: Optional[int] = None  # the last round relayed (or tried)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="round relay", daemon=True)

    def start(self) -> RoundRelay:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.averaging_timeout + 5)

    def _run(self) -> None:
        while not self._stop.wait(LOOK_EVERY if self._relaying else IDLE_LOOK_EVERY):
            try:
                due = self._due_round()
                if due is not None:
                    self._relay(*due)
            except Exception as e:  # a DHT read or a round that broke: the next look tries again
                logger.warning(f"Relaying an outer round failed: {type(e).__name__}: {e}")

    def _due_round(self) -> Optional[tuple[int, Optional[float]]]:
        """The round to relay now, and when it is due when it is paced in seconds: all trainers are in client mode,
        two or more, and their samples for their newest round (within the coordinator's clock) reach the target, or
        the round's time on the grid is a matchmaking time away. None otherwise."""
        records = read_records(self.outer.dht, self.progress_key, LocalTrainingProgress)
        bound = self.outer.epoch_bound()
        records = [record for record in records if bound is None or record.epoch <= bound]
        relaying = len(records) >= 2 and all(record.client_mode for record in records)
        if relaying != self._relaying:
            self._relaying = relaying
            self.report("Relaying outer rounds: every trainer is behind NAT (client mode), so this coordinator leads"
                        " their groups" if relaying else "No longer relaying outer rounds: a trainer that can be"
                        " dialled leads them, or fewer than two train")
        if not relaying:
            return None
        round_ = max(record.epoch for record in records)
        if self.round_seconds:
            now = time.time()
            at = group_time(next_round_time(now, self.round_seconds), self.matchmaking_time)
            return (round_, at) if at != self._last_time and at - now <= self.matchmaking_time else None
        samples = sum(record.samples_accumulated for record in records if record.epoch == round_)
        if round_ == self._last_round or samples < self.samples_per_peer * len(records):
            return None
        return round_, None

    def _relay(self, round_: int, at: Optional[float]) -> None:
        self._last_round, self._last_time = round_, at
        if self.robust:
            self.outer.set_group_bits(f"{round_ % 4:02b}")
        started, cpu_before = time.perf_counter(), self._averager_cpu_seconds()
        # paced in seconds: the group forms when the peers' own searches aim (hivetrain.diloco.group_time)
        wait = max(0.0, at - time.time()) if at is not None else 0.0
        try:
            gathered = self.outer.step(gather=RELAY_GATHER, scheduled_time=at, timeout=wait + self.averaging_timeout)
        except Exception as e:  # no peer came, a groupmate that vanished mid-round
            logger.info(f"Relaying outer round {round_} found no group: {type(e).__name__}: {e}")
            gathered = None
        trainers = 0 if gathered is None else sum(value != RELAY_GATHER for value in gathered.values())
        # the relay's cost to the coordinator: its averager's process does the reducing
        self.events("relayed", round=round_, trainers=trainers, seconds=time.perf_counter() - started,
                    cpu_seconds=self._averager_cpu_seconds() - cpu_before, bytes=self.outer.relayed_bytes(trainers))

    def _averager_cpu_seconds(self) -> float:
        """CPU time of the averager's own process (hivemind runs each averager in a child process) so far."""
        times = psutil.Process(self.outer.pid).cpu_times()
        return times.user + times.system
