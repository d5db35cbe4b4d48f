"""A last peer's state handed to the coordinator before it leaves.

The coordinator's state holder takes the swarm's state only when it validates it (every --validate-every swarm
epochs, at its looks). The peers that stopped last withdrew their offers at once, so whatever they trained after
the coordinator's last download left with them: `make demo` reported the validation of its fifth round of six, and
on a fast machine its peers could finish before any download at all ("the coordinator recorded no validation"). A
peer that leaves while no other peer trains now keeps its offer to share its state up, after its goodbye record,
until the coordinator's signed clock says its holder has taken that state (ClockRecord.held) or `timeout` seconds
pass; the coordinator downloads from it once its look finds no peer training (hivetrain.roles.coordinator.validator).

Who waits: a peer reads the others' metrics records after its own goodbye is stored. Of two peers that leave
together, the later to store its goodbye reads the other's, so at least one of them waits: the last state of the
swarm is never left without a holder while a coordinator that takes states is there.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import hivemind
from hivemind.utils import get_dht_time

from hivetrain.clock import CLOCK_FRESH, ClockRecord
from hivetrain.coordinator_watch import CoordinatorWatch
from hivetrain.telemetry import read_peer_records

HAND_OVER_TIMEOUT = 60.0  # seconds a last peer keeps its state up for the coordinator at most
# ... when it leaves on Ctrl-C or SIGTERM: a notebook's stop button, a test's teardown, a machine shutting down give a
# process some grace before they kill it; a coordinator's look (10 s by default) and its download fit in this
HAND_OVER_TIMEOUT_INTERRUPTED = 20.0
HAND_OVER_POLL = 0.5  # seconds between two reads of the coordinator's clock meanwhile

logger = logging.getLogger(__name__)


def others_training(dht: hivemind.DHT, run_id: str, own_peer_id: str) -> bool:
    """Whether another peer's metrics record is live and not a goodbye (it goes on with the swarm's state)."""
    return any(record.peer_id != own_peer_id and not record.left for record in read_peer_records(dht, run_id))


def hand_over_state(epoch: int, read_clock: Callable[[], Optional[ClockRecord]], others: Callable[[], bool],
                    report: Callable[[str], None], timeout: float = HAND_OVER_TIMEOUT,
                    now: Callable[[], float] = get_dht_time) -> Optional[bool]:
    """Wait, at most `timeout` seconds, until the coordinator's clock (`read_clock()`) says its holder has this
    peer's state of swarm epoch (diloco: outer round) `epoch`, unless there is nothing to hand over: no clock, or none
    published within CLOCK_FRESH seconds (by `now()`: the coordinator is gone), a coordinator that takes no states (it
    does not validate: `held` is None), one that holds this epoch already, or `others()` still training. Returns None
    then, True once the coordinator holds it, False when it did not in time, stopped publishing its clock meanwhile,
    or Ctrl-C cut the wait short. `report` gets one line as the wait begins and one as it ends."""
    clock = read_clock()
    if clock is None or now() - clock.time > CLOCK_FRESH or clock.held is None or clock.held >= epoch or others():
        return None
    report(f"Handing this peer's state (swarm epoch {epoch}) to the coordinator before leaving: no other peer trains,"
           f" and the coordinator holds swarm epoch {clock.held} (up to {timeout:.0f} s; Ctrl-C leaves now)")
    held, published, deadline = clock.held, clock.time, time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            time.sleep(HAND_OVER_POLL)
            try:
                clock = read_clock()
            except Exception as e:  # a read that failed: the next one may not
                logger.debug(f"Could not read the coordinator's clock: {type(e).__name__}: {e}")
                clock = None
            published = max(published, clock.time) if clock is not None else published
            if now() - published > CLOCK_FRESH:
                report(f"The coordinator stopped publishing its clock: leaving; it holds swarm epoch {held}")
                return False
            if clock is not None and clock.held is not None:
                held = max(held, clock.held)
                if held >= epoch:
                    report(f"The coordinator holds this peer's last state (swarm epoch {held})")
                    return True
    except KeyboardInterrupt:
        report(f"Leaving without handing the state over: the coordinator holds swarm epoch {held}")
        return False
    report(f"The coordinator did not take this peer's state within {timeout:.0f} s: it holds swarm epoch {held}")
    return False


def hand_over_from(dht: hivemind.DHT, run_id: str, epoch: int, watch: Optional[CoordinatorWatch],
                   report: Callable[[str], None], timeout: float = HAND_OVER_TIMEOUT) -> Optional[bool]:
    """hand_over_state for a peer on `dht` whose state is of swarm epoch (round) `epoch`, watching its coordinator
    with `watch`. None without a coordinator to hand it to, or in client mode: nobody can dial such a peer, so it
    serves no state."""
    if watch is None or dht.client_mode:
        return None
    own = dht.peer_id.to_base58()
    return hand_over_state(epoch, watch.clock.read, lambda: others_training(dht, run_id, own), report, timeout)
