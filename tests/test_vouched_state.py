"""A state is taken once vouched for (issue 27, finding 3): a holder serves whatever parameters it likes at the swarm's
epoch, in the model's shapes, so a download is taken only when a second holder serves the same state (within
rounding), or from the run's pinned coordinator, or from the one holder of the newest epoch there is."""

import functools
import time

import hivemind
import pytest
import torch
from hivemind.optim.state_averager import TrainingStateAverager

from hivetrain.hivemind_internals import (MAX_STATE_ASKS, STATE_AGREEMENT, BoundedStateAverager, asking_order,
                                          named_for_rpc_as, state_disagreement)

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
PREFIX = "vouched_state_averager"


@named_for_rpc_as(TrainingStateAverager)  # served under hivemind's name, as every peer's
class CountingHolder(BoundedStateAverager):
    """A BoundedStateAverager that counts the downloads of its state it answers."""

    served = 0

    def get_current_state(self):
        self.served += 1  # hivemind asks the host process once per download it answers
        return super().get_current_state()


@pytest.fixture
def swarm(cleanup):
    """A function that starts a CountingHolder (a Linear(4, 2) whose weights are `fill`, plus `noise` relative
    to them) on a DHT of its own joined to one bootstrap node; and one that waits until `count` holders are
    declared."""
    bootstrap = hivemind.DHT(host_maddrs=LOOPBACK, start=True)
    cleanup.append(bootstrap)
    addresses = [str(a) for a in bootstrap.get_visible_maddrs()]

    def averager(fill: float, epoch: int = 0, priority: float = 0, noise: float = 0.0,
                 holder: bool = True) -> CountingHolder:
        dht = hivemind.DHT(host_maddrs=LOOPBACK, initial_peers=addresses, start=True)
        cleanup.append(dht)
        model = torch.nn.Linear(4, 2)
        with torch.no_grad():
            model.weight.fill_(fill).mul_(1 + noise * torch.linspace(-1, 1, 8).view(2, 4))
            model.bias.fill_(fill)
        made = CountingHolder(dht=dht, prefix=PREFIX, params=model.parameters(), start=True,
                              optimizer=functools.partial(torch.optim.SGD, lr=0.1), allow_state_sharing=holder)
        cleanup.append(made)  # shut down before its DHT (cleanup runs in reverse)
        made.local_epoch, made.state_sharing_priority = epoch, priority
        return made

    def wait_for_holders(peer: BoundedStateAverager, count: int) -> None:
        deadline = time.monotonic() + 30
        while len((peer.dht.get(f"{PREFIX}.all_averagers", latest=True) or ({}, None))[0]) < count:
            assert time.monotonic() < deadline, "the holders never declared their states"
            time.sleep(0.2)

    return averager, wait_for_holders


def _holds(peer: BoundedStateAverager, fill: float) -> bool:
    return all(torch.allclose(p, torch.full_like(p, fill), rtol=2 * STATE_AGREEMENT) for p in peer.main_parameters)


def test_a_poisoned_holder_is_passed_over_for_two_that_agree(swarm, takeover_rows):
    """The poisoner declares the highest priority and serves a state of the swarm's epoch, in the model's shapes; two
    honest holders serve the same state, one of them off by rounding (fp16 on the wire). The joiner takes theirs,
    whether it asked the poisoner first or not."""
    averager, wait_for_holders = swarm
    averager(-5.0, epoch=12, priority=12)  # the poisoner
    averager(1.0, epoch=12, priority=11.5)
    averager(1.0, epoch=12, priority=11, noise=STATE_AGREEMENT / 4)
    joiner = averager(0.0, holder=False)
    wait_for_holders(joiner, 3)
    joiner.load_state_from_peers(timeout=10)
    assert joiner.local_epoch == 12 and _holds(joiner, 1.0)
    takeover_rows.add(3, "a holder declares the highest priority and serves its own parameters at the swarm's epoch,"
                         " in the model's shapes; two honest holders serve the swarm's, off by rounding",
                      f"a joiner took the honest holders' state (epoch {joiner.local_epoch}), which two agreed on")


def test_holders_that_disagree_give_no_state_but_the_pinned_coordinators(swarm):
    """One honest holder and one poisoner at the same epoch: nothing tells them apart, so the joiner takes neither
    and keeps its own state; with the coordinator's holder trusted, it takes the coordinator's state, although older
    and asked last."""
    averager, wait_for_holders = swarm
    averager(-5.0, epoch=12, priority=12)
    averager(1.0, epoch=12, priority=12)
    coordinator = averager(2.0, epoch=9, priority=9)
    joiner = averager(0.0, holder=False)
    wait_for_holders(joiner, 3)
    joiner.load_state_from_peers(timeout=10)  # the coordinator's state is one like any other here: three disagree
    assert joiner.local_epoch == 0 and _holds(joiner, 0.0)
    joiner.trusted_holder = coordinator.peer_id.to_base58()
    joiner.load_state_from_peers(timeout=10)
    assert joiner.local_epoch == 9 and _holds(joiner, 2.0)


def test_a_lone_holder_is_taken_unless_the_coordinators_state_is_newer(swarm):
    """With one holder besides the coordinator there is nobody to hold its state against: a swarm's first volunteer
    serves the second. It is taken when it is newer than the coordinator's (whose copy trails the swarm by a
    validation), and the coordinator's is taken when that is newer."""
    averager, wait_for_holders = swarm
    coordinator = averager(2.0, epoch=9, priority=9)
    volunteer = averager(1.0, epoch=12, priority=12)
    joiner = averager(0.0, holder=False)
    joiner.trusted_holder = coordinator.peer_id.to_base58()
    wait_for_holders(joiner, 2)
    joiner.load_state_from_peers(timeout=10)
    assert joiner.local_epoch == 12 and _holds(joiner, 1.0)
    volunteer.state_sharing_priority = 8  # its offer is renewed at once (LastingStateOffer)
    coordinator.local_epoch, coordinator.state_sharing_priority = 14, 14
    deadline = time.monotonic() + 30
    while joiner.local_epoch != 14:
        assert time.monotonic() < deadline, "the joiner never took the coordinator's newer state"
        joiner.load_state_from_peers(timeout=10)
        time.sleep(0.2)
    assert _holds(joiner, 2.0)


def test_a_peer_just_started_does_not_stand_against_the_one_trained_holder(swarm):
    """A peer declares its untrained state of epoch 0 until it has loaded one: beside a trained holder it is not
    asked, and the trained holder's state, the one there is, is taken."""
    averager, wait_for_holders = swarm
    averager(1.0, epoch=12, priority=12)
    averager(-3.0, epoch=0, priority=0)
    joiner = averager(0.0, holder=False)
    wait_for_holders(joiner, 2)
    joiner.load_state_from_peers(timeout=10)
    assert joiner.local_epoch == 12 and _holds(joiner, 1.0)


def test_a_holder_behind_the_swarm_does_not_stand_against_the_one_in_step(swarm):
    """A peer that fell behind serves its old epoch until it has loaded a new one: the one holder of the newest epoch
    is taken over it, and over the coordinator's older state. Two holders of the newest epoch that disagree are still
    taken on neither's word."""
    averager, wait_for_holders = swarm
    coordinator = averager(2.0, epoch=3, priority=3)
    averager(-3.0, epoch=5, priority=5)  # behind
    averager(1.0, epoch=12, priority=12)
    joiner = averager(0.0, holder=False)
    joiner.trusted_holder = coordinator.peer_id.to_base58()
    wait_for_holders(joiner, 3)
    joiner.load_state_from_peers(timeout=10)
    assert joiner.local_epoch == 12 and _holds(joiner, 1.0)
    averager(-5.0, epoch=12, priority=12)  # a poisoner beside the one in step
    late = averager(0.0, holder=False)
    late.trusted_holder = coordinator.peer_id.to_base58()
    wait_for_holders(late, 4)
    late.load_state_from_peers(timeout=10)
    assert late.local_epoch == 3 and _holds(late, 2.0)


@pytest.mark.parametrize("first, second, agree", [
    (({"epoch": 3}, [torch.ones(4)]), ({"epoch": 3}, [torch.ones(4) * (1 + STATE_AGREEMENT / 2)]), True),
    (({"epoch": 3}, [torch.ones(4)]), ({"epoch": 3}, [torch.ones(4) * (1 + 2 * STATE_AGREEMENT)]), False),
    (({"epoch": 3}, [torch.ones(4)]), ({"epoch": 4}, [torch.ones(4)]), False),
    (({"round": 3}, [torch.zeros(4)]), ({"round": 3}, [torch.zeros(4)]), True),
    (({"round": 3, "in_flight": True}, [torch.ones(4)]), ({"round": 3}, [torch.ones(4)]), False),
    (({"epoch": 3}, [torch.full((4,), float("nan"))]), ({"epoch": 3}, [torch.full((4,), float("nan"))]), False),
    (({}, [torch.ones(4)]), ({}, [torch.ones(4)]), False),  # no epoch named: nothing to hold it against
    (({"epoch": 3}, [torch.ones(4), torch.ones(2)]), ({"epoch": 3}, [torch.ones(4), -torch.ones(2)]), True),
], ids=["rounding", "one-percent-apart", "another-epoch", "zeros", "one-in-flight", "nan", "no-epoch",
        "beyond-the-compared"])
def test_two_states_agree_on_their_epoch_and_parameters_within_rounding(first, second, agree):
    assert (state_disagreement(first, second, compared=1) is None) is agree


def test_a_download_asks_at_most_max_state_asks_holders_that_serve(swarm):
    """Holders that all disagree: the joiner downloads from MAX_STATE_ASKS of them (each state is held in memory until
    one is taken), takes none, and never asks the rest."""
    averager, wait_for_holders = swarm
    holders = [averager(float(i), epoch=12, priority=12 - i) for i in range(MAX_STATE_ASKS + 1)]
    joiner = averager(0.5, holder=False)
    wait_for_holders(joiner, len(holders))
    joiner.load_state_from_peers(timeout=10)
    assert joiner.local_epoch == 0 and _holds(joiner, 0.5)
    assert sorted(holder.served for holder in holders) == [0] + [1] * MAX_STATE_ASKS


def test_a_priority_declared_beyond_the_others_does_not_put_its_holder_first():
    """Two keys of one attacker declare more than the three honest holders: counted up to the median of those
    declared, they are first in line about as often as their share (2 of 5), not always, and two of them ahead of
    every honest holder no more than by chance. Holders at epoch 0 are left out beside later ones; older holders,
    below the median, still come last."""
    priorities = {"attacker-1": 20.0, "attacker-2": 20.0, "honest-1": 12.0, "honest-2": 12.0, "honest-3": 12.0,
                  "stale": 9.0, "just-started": 0.0}
    orders = [asking_order(priorities) for _ in range(400)]
    assert all(order[-1] == "stale" and "just-started" not in order for order in orders)
    first_attacker = sum(order[0].startswith("attacker") for order in orders) / len(orders)
    both_first = sum({*order[:2]} == {"attacker-1", "attacker-2"} for order in orders) / len(orders)
    assert 0.25 < first_attacker < 0.55  # 2 of 5 expected
    assert both_first < 0.2  # 1 in 10 expected
    assert asking_order({"a": 0.0, "b": 0.0}) and asking_order({}) == []  # all at epoch 0: all asked
