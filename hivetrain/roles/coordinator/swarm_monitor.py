"""The coordinator's watch over who trains in the swarm and how fast (SwarmMonitor): every look reads the peers'
signed records and hivemind's progress into the metrics store and to `loggers` (TensorBoard's SummaryWriter, and
W&B's run behind the same calls: hivetrain.wandb_run.WandbScalars). It never stops on what a peer did or failed to
do. How good the shared model is: hivetrain.roles.coordinator.validator."""

from __future__ import annotations

import logging
import time
from statistics import mean
from typing import Optional, Sequence

import hivemind
from hivemind.dht.crypto import RSASignatureValidator

from hivetrain.clock import read_clock, swarm_epoch
from hivetrain.config import RunConfig
from hivetrain.round_schedule import next_round_time, paced_round_samples
from hivetrain.metrics_store import MetricsWriter, PeerRow, SwarmSnapshot
from hivetrain.telemetry import PeerIdOwners, bounded_sum, finite_or_none, read_peer_records, read_swarm_progress

logger = logging.getLogger(__name__)


class SwarmMonitor:
    def __init__(self, dht: hivemind.DHT, config: RunConfig, writer: MetricsWriter, loggers: Sequence = (),
                 start_epoch: int = 0):
        self.dht, self.config, self.writer, self.loggers = dht, config, writer, loggers
        self.start_epoch = start_epoch  # a resumed run starts at its checkpoint's epoch
        self.latest: Optional[SwarmSnapshot] = None
        self.owners = PeerIdOwners()  # one row per peer ID, written by the key that first claimed it
        # Once no peer trains: the newest epoch the last look's goodbye records claim, whose state their writers keep
        # up for the coordinator (hivetrain.hand_over); None while any peer trains. A lone claim, beyond the count
        # after a rollback (served ahead of it), or anything a writer liked: the download is bounded all the same.
        self.last_peers_epoch: Optional[int] = None

    @property
    def epoch(self) -> int:
        """The swarm's epoch by this monitor's count so far (hivetrain.clock.swarm_epoch)."""
        return self.latest.epoch if self.latest else self.start_epoch

    def refresh(self) -> SwarmSnapshot:
        """Read every peer's record and hivemind's progress, aggregate, and record both."""
        now = time.time()
        # A coordinator restarted on its identity goes on from the count it published before (its signed clock
        # lives on in the swarm a while), not from 0: peers read a count that goes back as a restart, but a lone
        # peer far ahead of 0 would never move it (hivetrain.clock.swarm_epoch).
        published = read_clock(self.dht, self.config.run_id, RSASignatureValidator().local_public_key)
        counted = max(self.epoch, published.epoch if published is not None else 0)
        records = read_peer_records(self.dht, self.config.run_id, self.owners)
        progress = read_swarm_progress(self.dht, self.config.run_id, counted)
        # Seen, first seen and left by this look's clock, never by a peer's (its `time` may be anything: a record
        # dated a century ahead would keep a peer "online" for ever and break every date shown).
        self.writer.upsert_peers([
            PeerRow(peer_id=r.peer_id, name=r.name, hardware=r.hardware, client_mode=r.client_mode, epoch=r.epoch,
                    samples_per_second=r.samples_per_second, loss=r.loss, samples=r.samples, first_seen=now,
                    last_seen=now, inner_steps=r.inner_steps, pseudo_gradient_norm=r.pseudo_gradient_norm,
                    round_bytes=r.round_bytes, train_seconds=r.train_seconds, swarm_seconds=r.swarm_seconds,
                    left_at=now if r.left else None, rounds_averaged=r.rounds_averaged, rounds_alone=r.rounds_alone,
                    rounds_failed=r.rounds_failed)
            for r in records
        ])
        self.writer.mark_left({r.peer_id for r in records}, now)  # killed or cut off: their records lapsed
        # A leaver's last record still says how far the swarm got: peers that stop at an epoch withdraw their
        # progress records within a second of reaching it, often before this look could read them.
        reached = swarm_epoch(counted, [r.epoch for r in records])  # no one record sets it (hivetrain.clock)
        leaving = [r.epoch for r in records if r.left]
        records = [r for r in records if not r.left]
        self.last_peers_epoch = max(leaving) if leaving and not records else None
        # What the peers really train per wall-clock second, rounds and state downloads included: each peer's record
        # counts its samples between two records over the time between them. (hivemind's progress records carry a
        # compute-only rate that leaves the rounds out: on the sync demo about 20 times what the peers trained.)
        samples_per_second = bounded_sum(r.samples_per_second for r in records)
        swarm = self.config.swarm
        # diloco: a round is due after H steps of the run's batch per peer (hivetrain.round_schedule.RoundTracker),
        # or, paced in seconds, at its time on the clock's grid, after what the swarm trains in that time
        target = (swarm.inner_steps * self.config.batch_size * max(1, progress.peers) if swarm.mode == "diloco"
                  else swarm.target_batch_size)
        remaining = max(0, target - progress.samples_accumulated)
        eta = finite_or_none(remaining / samples_per_second) if samples_per_second > 0 else None
        if swarm.mode == "diloco" and swarm.round_seconds:
            target = paced_round_samples(samples_per_second, swarm.round_seconds)
            eta = next_round_time(now, swarm.round_seconds) - now
        losses = [r.loss for r in records if r.loss is not None]
        snapshot = SwarmSnapshot(
            time=now,
            # the run's epoch never goes back, even when every peer has left and their records expired
            epoch=max(progress.epoch, reached, counted),
            alive_peers=len(records),
            clients=sum(r.client_mode for r in records),
            samples_per_second=samples_per_second,
            samples_accumulated=progress.samples_accumulated,
            target_batch_size=target,
            eta_seconds=eta,
            mean_loss=mean(losses) if losses else None,
        )
        self.writer.add_snapshot(snapshot)
        for scalars in self.loggers:
            for name in ("alive_peers", "samples_per_second", "mean_loss"):
                value = getattr(snapshot, name)
                if value is not None:
                    scalars.add_scalar(f"swarm/{name}", value, snapshot.epoch, walltime=now)
        self.latest = snapshot
        return snapshot
