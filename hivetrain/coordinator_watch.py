"""What a peer takes from the run's coordinator alone, in records signed by the key that signed the run record: its
rollbacks (hivetrain.rollback), and its clock (hivetrain.clock), which bounds the epochs and rounds other peers may
claim, and this peer's own.

A peer cut off from the swarm trains on alone, and a lone peer's epochs come fast (there is nobody to wait for): one
cut off for 100 s was 240 epochs ahead of the others when its link came back. The others skip a record that far
beyond the clock, and a peer ahead of everyone never downloads: it trained on alone for good, beside the swarm.
Back online it finds itself beyond the clock, and it is the one to take the swarm's state (ran_ahead), dropping
what it trained alone; a majority of the swarm, not one peer, sets where the run is. It acts on a count that changed
lately and did not go back (ClockWatcher.fresh_count): one still cut off reads the count it had, and a coordinator
restarted without its count says 0 until it has counted the swarm again.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import hivemind

from hivetrain.clock import EPOCHS_AHEAD, ClockWatcher
from hivetrain.record_guard import signer_peer_id
from hivetrain.rollback import RollbackWatcher

# Seconds between two tries of a peer beyond the clock to take the swarm's state: while it is still cut off, each try
# waits for a download that cannot come.
REJOIN_EVERY = 10.0

logger = logging.getLogger(__name__)


class CoordinatorWatch:
    """A peer's watch on its coordinator's rollbacks and clock."""

    def __init__(self, dht: hivemind.DHT, run_id: str, coordinator_key: bytes):
        self.rollbacks = RollbackWatcher(dht, run_id, coordinator_key).start()
        self.clock = ClockWatcher(dht, run_id, coordinator_key).start()
        # The coordinator's peer ID (its key's hash): the holder a rollback's state is taken from, and no other. A
        # peer may hold a state of the very epoch the rollback serves: in CI an attacker trained up to it before the
        # honest peer's download, and hivemind's order among equal holders picked the attacker's.
        self.holder = signer_peer_id(coordinator_key)
        self._next_rejoin = 0.0

    def bound(self, tracker: Any, averager: Any) -> None:
        """Bound by the coordinator's clock the epochs `tracker` (a vetted tracker) takes from other peers, and those
        `averager` takes from a downloaded state (a BoundedStateAverager's epoch, an OuterState's round) and from its
        groupmates (an OuterState's round); and let `averager` take the coordinator's own state without a second
        holder's word (BoundedDownloads.trusted_holder): its holder took it from holders that agreed."""
        tracker.epoch_bound = averager.epoch_bound = self.clock.bound  # a VettedProgressTracker, a BoundedDownloads
        averager.trusted_holder = self.holder

    def ran_ahead(self, epoch: int, unit: str = "swarm epoch") -> Optional[int]:
        """The coordinator's count, fresh, when this peer's own `epoch` (`unit`: diloco's outer round) is more than
        EPOCHS_AHEAD beyond it, at most once per REJOIN_EVERY seconds, saying so: the peer is to take the swarm's
        state. None otherwise, and while the count is old (this peer is still cut off: there is no state to take)."""
        count, now = self.clock.fresh_count(), time.monotonic()
        if count is None or epoch <= count + EPOCHS_AHEAD or now < self._next_rejoin:
            return None
        self._next_rejoin = now + REJOIN_EVERY
        logger.warning(f"This peer is at {unit} {epoch}, far beyond the coordinator's count ({count}): it trained"
                       f" alone while cut off. Loading the swarm's state")
        return count

    def stop(self) -> None:
        self.rollbacks.stop()
        self.clock.stop()
