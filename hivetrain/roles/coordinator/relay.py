"""The coordinator's part in the averaging rounds of peers that nobody can dial.

hivemind's averager joins only groups that a dialable peer leads: a peer behind NAT averages in client mode, as a
follower. In a swarm of such peers alone (friends on Colab and Kaggle, home machines) nobody leads, and every round
finds no group: a diloco peer only ever takes its own outer steps, and a sync peer misses each swarm epoch's gradient
all-reduce (and reloads the swarm's state instead). So while every trainer in the progress records is in client mode,
the coordinator takes part in each round as hivemind's auxiliary peer: it leads the group and reduces every part of
the all-reduce, with no weight and no tensors of its own, the run's robust aggregation applied as on any reducer.

- diloco (RoundRelay): the state holder's outer-state averager, on the peers' prefix. It gathers RELAY_GATHER, which
  the peers do not count as a groupmate (OuterState).
- sync (GradientRelay): an auxiliary averager answering as the peers' hivemind GradientAverager, on its prefix,
  started the first time every trainer is found behind NAT (a process of its own, with a copy of the gradients: a run
  with a trainer that can be dialled never needs it). Then the epoch's state averaging (hivemind.Optimizer's, every
  average_state_every epochs), through the state holder's averager, auxiliary too: without it each peer searched the
  whole averaging timeout for a state group every epoch (10 of every 11 s in the demo preset), and peers whose
  parameters went apart (a gradient round that missed one) stayed apart for good, with no state to load either
  (nobody can download from a peer in client mode).

Its search for the group starts when the round comes due by the records, as the peers' own do, and lasts the run's
matchmaking time: the peers that notice the round within it average together. Rounds paced in seconds fall due on
the clock's grid (hivetrain.round_schedule.next_round_time): its group forms when theirs does (group_time).
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from typing import Any, Callable, Optional

import psutil
import torch
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.progress_tracker import LocalTrainingProgress
from hivemind.utils import get_dht_time

from hivetrain.config import RunConfig
from hivetrain.round_schedule import group_time, next_round_time
from hivetrain.events import EventLog
from hivetrain.hivemind_internals import (MIN_ROBUST_GROUP_SIZE, members_only_class, named_for_rpc_as,
                                          robust_averager_class)
from hivetrain.outer_state import RELAY_GATHER, OuterState, round_matchmaking
from hivetrain.robust import RobustAggregation
from hivetrain.swarm import read_records
from hivetrain.swarm_options import COMPRESSION, wire_bytes

logger = logging.getLogger(__name__)

LOOK_EVERY = 0.25  # seconds between two reads of the progress records while relaying and no round is due
AVERAGER_START_TIMEOUT = 30.0  # seconds for the sync relay's averager process to come up
IDLE_LOOK_EVERY = 2.0  # ...while a trainer that can be dialled leads the rounds (each read parses every record)


def print_flushed(line: str) -> None:
    print(line, flush=True)


class Relay:
    """Watches the progress records in a thread of its own, and relays each round that falls due while every trainer
    is in client mode (`_due`, `_relay`: the mode's own).

    Args:
        dht: the coordinator's DHT node, where it reads the progress records.
        progress_key: the DHT key of the peers' progress records.
        averaging_timeout: seconds to look for the round's group before the round is left to the peers alone.
        epoch_bound: the highest round a record may name (hivetrain.clock); records beyond it are left out.
        events: where each relayed round is told (`relayed`).
        report: the coordinator's console, told when relaying starts and stops.
    """

    what = "rounds"  # what it relays, in its console lines
    # the coordinator's auxiliary averager that relays (it contributes nothing to a round); a subclass's to set
    averager: Optional[DecentralizedAverager] = None

    def __init__(self, dht: DHT, progress_key: str, averaging_timeout: float,
                 epoch_bound: Callable[[], Optional[int]] = lambda: None, events: EventLog = EventLog(None),
                 report: Callable[[str], None] = print_flushed):
        self.dht, self.progress_key, self.averaging_timeout = dht, progress_key, averaging_timeout
        self.epoch_bound, self.events, self.report = epoch_bound, events, report
        self._relaying = False  # the last look found only peers in client mode
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{self.what} relay", daemon=True)

    def start(self) -> Relay:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.averaging_timeout + 5)

    def _run(self) -> None:
        while not self._stop.wait(LOOK_EVERY if self._relaying else IDLE_LOOK_EVERY):
            try:
                records = self._trainers_behind_nat()
                due = self._due(records) if records else None
                if due is not None:
                    self._relay(*due)
            except Exception as e:  # a DHT read or a round that broke: the next look tries again
                logger.warning(f"Relaying {self.what} failed: {type(e).__name__}: {e}")

    def _trainers_behind_nat(self) -> list[LocalTrainingProgress]:
        """The trainers' progress records (within the coordinator's clock) when they are two or more and all in client
        mode; none otherwise. Tells the console when that changes."""
        records = read_records(self.dht, self.progress_key, LocalTrainingProgress)
        bound = self.epoch_bound()
        records = [record for record in records if bound is None or record.epoch <= bound]
        relaying = len(records) >= 2 and all(record.client_mode for record in records)
        if relaying != self._relaying:
            if relaying:
                self._prepare()
            self._relaying = relaying
            self.report(f"Relaying {self.what}: every trainer is behind NAT (client mode), so this coordinator leads"
                        f" their groups" if relaying else f"No longer relaying {self.what}: a trainer that can be"
                        f" dialled leads them, or fewer than two train")
        return records if relaying else []

    def _prepare(self) -> None:
        """What relaying needs before its first round (its averager), made once every trainer is behind NAT."""

    def _due(self, records: list[LocalTrainingProgress]) -> Optional[tuple[Any, ...]]:
        raise NotImplementedError

    def _relay(self, *due: Any) -> None:
        raise NotImplementedError

    def _averager_cpu_seconds(self) -> float:
        """CPU time of the averager's own process (hivemind runs each averager in a child process) so far."""
        times = psutil.Process(self.averager.pid).cpu_times()
        return times.user + times.system


class RoundRelay(Relay):
    """Leads the outer rounds of a diloco swarm whose trainers are all in client mode.

    Args:
        outer: the coordinator's OuterState, created auxiliary (it contributes nothing to a round).
        progress_key: the DHT key of the peers' progress records (the round tracker's).
        samples_per_peer: H inner steps of the run's batch: a round is due once the records' samples for it reach
            this many per trainer, as the peers' RoundTracker counts.
        averaging_timeout: seconds to look for the round's group before the round is left to the peers alone.
        round_seconds: the run's rounds paced in seconds (None: by samples, `samples_per_peer`).
        matchmaking_time: how long ahead of a round paced in seconds its search for the group starts.
        events: where each relayed round is told (`relayed`).
        report: the coordinator's console, told when relaying starts and stops.
    """

    what = "outer rounds"

    def __init__(self, outer: OuterState, progress_key: str, samples_per_peer: int, averaging_timeout: float,
                 events: EventLog = EventLog(None), report: Callable[[str], None] = print_flushed,
                 round_seconds: Optional[float] = None, matchmaking_time: float = 0.0):
        super().__init__(outer.dht, progress_key, averaging_timeout, lambda: outer.epoch_bound(), events, report)
        self.averager = self.outer = outer  # the state holder's: it exists whether or not it relays
        self.samples_per_peer = samples_per_peer
        self.round_seconds, self.matchmaking_time = round_seconds, matchmaking_time
        self._last_time: Optional[float] = None  # rounds paced in seconds: the grid time last relayed (or tried)
        self._last_round: Optional[int] = None  # the last round relayed (or tried)

    def _due(self, records: list[LocalTrainingProgress]) -> Optional[tuple[int, Optional[float]]]:
        """The round to relay now, and when it is due when it is paced in seconds: the trainers' samples for their
        newest round reach the target, or the round's time on the grid is a matchmaking time away. None otherwise."""
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
        self.outer.look_in_groups_of(round_)
        started, cpu_before = time.perf_counter(), self._averager_cpu_seconds()
        # paced in seconds: the group forms when the peers' own searches aim
        # (hivetrain.round_schedule.group_time)
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


@named_for_rpc_as(GradientAverager)  # the peers' gradient averagers call it by hivemind's name
class RelayedGradients(DecentralizedAverager):
    """An auxiliary averager of a sync run's gradients, for GradientRelay: tensors of the gradients' shapes, which it
    only reduces (hivemind's auxiliary mode sends none of its own). Started from the relay's thread, where hivemind's
    run_in_background cannot set SIGINT aside for the process it forks (signals are the main thread's): its process
    does so itself, and the coordinator's Ctrl-C stops it through the coordinator's shutdown, as any averager."""

    def run(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        super().run()

    def start_in_thread(self, timeout: Optional[float] = None) -> None:
        """hivemind's run_in_background, from a thread other than the main one."""
        self.start()
        self.wait_until_ready(timeout)


def relay_group_size(aggregation: Optional[RobustAggregation]) -> dict:
    """The averager arguments of a coordinator's auxiliary averager that leads the peers' groups in a robust run: it
    brings no copy of its own, and the copies must still be enough. No argument otherwise."""
    return {} if aggregation is None else dict(min_group_size=MIN_ROBUST_GROUP_SIZE + 1)


def relay_averager_class(averager_class: type, aggregation: Optional[RobustAggregation]) -> tuple[type, dict]:
    """The class and arguments of an auxiliary averager of the coordinator that leads the peers' groups: robust when
    the run is (relay_group_size); members-only otherwise, as every averager."""
    if aggregation is not None:
        return robust_averager_class(averager_class), dict(aggregation=aggregation, **relay_group_size(aggregation))
    return members_only_class(averager_class), {}


class GradientRelay(Relay):
    """Leads the gradient all-reduce of a sync swarm whose trainers are all in client mode: one round per swarm
    epoch, once the trainers' samples for their newest epoch reach the run's target batch (hivemind.Optimizer's own
    rule for the epoch's end), then the epoch's state averaging round when there is one. Built by `for_run`.

    Args:
        make_averager: makes an auxiliary averager on the peers' gradient prefix, not started (for_run's); called
            the first time every trainer is behind NAT.
        dht: the coordinator's DHT node.
        progress_key: the DHT key of the peers' progress records (hivemind.Optimizer's tracker's).
        target_batch_size: samples the swarm accumulates per swarm epoch.
        averaging_timeout: seconds to look for the round's group before the round is left to the peers alone.
        gradient_bytes: the gradients' size on the wire (the run's gradient compression).
        epoch_bound: the highest epoch a record may name (hivetrain.clock).
        events: where each relayed round is told (`relayed`, its `round` the swarm epoch; `relayed_state`, the
            epoch's state averaging).
        report: the coordinator's console, told when relaying starts and stops.
        state_averager: the state holder's averager, auxiliary, on the peers' state averager prefix: it leads the
            epoch's state averaging round. None: no state rounds.
        average_state_every: the run's swarm epochs between two state averaging rounds.
    """

    what = "gradient rounds"

    def __init__(self, make_averager: Callable[[], RelayedGradients], dht: DHT, progress_key: str,
                 target_batch_size: int, averaging_timeout: float, gradient_bytes: int,
                 epoch_bound: Callable[[], Optional[int]] = lambda: None, events: EventLog = EventLog(None),
                 report: Callable[[str], None] = print_flushed,
                 state_averager: Optional[DecentralizedAverager] = None, average_state_every: int = 1):
        super().__init__(dht, progress_key, averaging_timeout, epoch_bound, events, report)
        self.make_averager = make_averager
        self.target_batch_size, self.gradient_bytes = target_batch_size, gradient_bytes
        self.state_averager, self.average_state_every = state_averager, average_state_every
        self._last_epoch: Optional[int] = None  # the last epoch relayed (or tried)

    @classmethod
    def for_run(cls, dht: DHT, config: RunConfig, param_groups: list[dict],
                epoch_bound: Callable[[], Optional[int]] = lambda: None, events: EventLog = EventLog(None),
                report: Callable[[str], None] = print_flushed,
                state_averager: Optional[DecentralizedAverager] = None) -> GradientRelay:
        """The relay of a sync run, its averager on the prefix and with the matchmaking of the peers' gradient
        averagers (hivemind.Optimizer's, as hivetrain.swarm_optimizer builds it), over tensors of their gradients'
        shapes and order (every parameter of the optimizer's param groups), robust when the run is."""
        swarm = config.swarm
        gradients = [torch.zeros_like(param, device="cpu") for group in param_groups for param in group["params"]]
        averager_class, robust = relay_averager_class(RelayedGradients, RobustAggregation.for_swarm(swarm))
        compression = COMPRESSION[swarm.grad_compression]()
        matchmaking = round_matchmaking(swarm.matchmaking_time, swarm.averaging_timeout, swarm.next_chunk_timeout,
                                        swarm.target_group_size)
        def make_averager() -> RelayedGradients:
            return averager_class(averaged_tensors=gradients, dht=dht, prefix=f"{config.run_id}_grad_averager",
                                  auxiliary=True, compression=compression, start=False, **matchmaking, **robust)

        return cls(make_averager, dht, f"{config.run_id}_progress", swarm.target_batch_size, swarm.averaging_timeout,
                   wire_bytes(sum(g.numel() for g in gradients), compression), epoch_bound, events, report,
                   state_averager, swarm.average_state_every)

    def _prepare(self) -> None:
        if self.averager is None:
            averager = self.make_averager()
            averager.start_in_thread(timeout=AVERAGER_START_TIMEOUT)
            self.averager = averager

    def _due(self, records: list[LocalTrainingProgress]) -> Optional[tuple[int]]:
        """The newest epoch, once its samples reach the target batch as the peers' own trackers count them: each
        record's samples carried forward at its rate since it was written (hivemind's ProgressTracker). A peer steps
        at that estimate and then stops training until its round ends, so its records may never show the target
        itself: a relay that waited for them would miss the round."""
        epoch, samples = newest_epoch_samples(records, get_dht_time())
        if epoch == self._last_epoch or samples < self.target_batch_size:
            return None
        return (epoch,)

    def _relay(self, epoch: int) -> None:
        self._last_epoch = epoch
        started, cpu_before = time.perf_counter(), self._averager_cpu_seconds()
        trainers = self._lead(self.averager, f"the gradients of swarm epoch {epoch}")
        self.events("relayed", round=epoch, trainers=trainers, seconds=time.perf_counter() - started,
                    cpu_seconds=self._averager_cpu_seconds() - cpu_before, bytes=2 * trainers * self.gradient_bytes)
        # hivemind.Optimizer averages the state as it enters an epoch that average_state_every divides, right after
        # the epoch's optimizer step: this search starts as the peers' do, and ends no later than theirs (hivemind's
        # leader turns away a follower whose search ends first)
        if self.state_averager is not None and (epoch + 1) % self.average_state_every == 0:
            started = time.perf_counter()
            trainers = self._lead(self.state_averager, f"the state averaging of swarm epoch {epoch}")
            self.events("relayed_state", round=epoch, trainers=trainers, seconds=time.perf_counter() - started)

    def _lead(self, averager: DecentralizedAverager, what: str) -> int:
        """One round led by `averager`, auxiliary, as hivemind's plain averager runs it (a TrainingStateAverager's own
        step is a trainer's: its optimizer step, its epoch, its tensors). Returns the trainers that took part: none
        when no group formed within the averaging timeout."""
        try:
            gathered = DecentralizedAverager.step(averager, timeout=self.averaging_timeout)
        except Exception as e:  # no peer came, a groupmate that vanished mid-round
            logger.info(f"Relaying {what} found no group: {type(e).__name__}: {e}")
            return 0
        return 0 if gathered is None else sum(peer != averager.peer_id for peer in gathered)

    def stop(self) -> None:
        super().stop()
        if self.averager is not None:
            self.averager.shutdown()


def newest_epoch_samples(records: list[LocalTrainingProgress], now: float) -> tuple[int, float]:
    """The newest epoch among progress records, and its samples as hivemind's ProgressTracker estimates them at `now`:
    each record's own, plus what its peer trained since writing it at the rate it stated. A record whose rate or time
    is not a finite number adds its own samples only (the schema lets inf through, and anyone may write a record)."""
    epoch = max(record.epoch for record in records)
    samples = 0.0
    for record in records:
        if record.epoch == epoch:
            samples += record.samples_accumulated
            if math.isfinite(record.samples_per_second) and math.isfinite(record.time):
                samples += max(0.0, now - record.time) * record.samples_per_second
    return epoch, samples
