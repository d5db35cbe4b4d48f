"""Averaging in groups (SwarmConfig.target_group_size): eight peers that average in groups of two still converge to
the swarm's mean, and both swarm modes hand the cap to every averager that joins rounds."""

import threading

import torch
from hivemind.utils.crypto import RSAPrivateKey

from hivetrain.config import get_preset
from hivetrain.diloco import DiLoCoRounds
from hivetrain.model import create_model
from hivetrain.optimizer import make_optimizer
from hivetrain.swarm_optimizer import wrap_optimizer
from hivetrain.swarm_options import HivemindOptions
from hivetrain.swarm import DHTOptions, start_dht

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
PEERS, GROUP_SIZE, ROUNDS = 8, 2, 8


def _start_dhts(count: int) -> list:
    first = start_dht(DHTOptions(host_maddrs=LOOPBACK))
    initial_peers = [str(a) for a in first.get_visible_maddrs()]
    return [first] + [start_dht(DHTOptions(initial_peers=initial_peers, host_maddrs=LOOPBACK))
                      for _ in range(count - 1)]


def _spread(reference: torch.Tensor, parameters: list[torch.nn.Parameter]) -> float:
    """The peers' root-mean-square distance to `reference`."""
    return float(torch.stack([(p.detach() - reference).norm() ** 2 for p in parameters]).mean().sqrt())


def test_peers_in_groups_of_two_converge_to_the_swarm_mean():
    """Eight diloco outer states (the averager every diloco peer runs) with distinct random parameters, G = 2. A round
    with no training in between (local parameters = outer parameters, no momentum) is pure averaging, so one group of
    all eight would reach the mean of the starting parameters at once. In groups of two each round averages pairs: the
    mean stays where it was (equal weights), and since the pairs change from round to round, every peer's distance to
    that mean keeps shrinking. Were the pairs the same every round, nothing would move after the first one."""
    dhts = _start_dhts(PEERS)
    generator = torch.Generator().manual_seed(0)
    parameters = [torch.nn.Parameter(torch.randn(1000, generator=generator)) for _ in range(PEERS)]
    peers = []
    try:
        for dht, parameter in zip(dhts, parameters):
            # each peer in this process signs its progress with its own key
            peers.append(DiLoCoRounds(dht, "test_groups", [parameter], inner_steps=1, batch_size=1, outer_lr=0.7,
                                      outer_momentum=0.0, matchmaking_time=2.0, averaging_timeout=20.0,
                                      next_chunk_timeout=5.0, private_key=RSAPrivateKey(),
                                      target_group_size=GROUP_SIZE))
        swarm_mean = torch.stack([p.detach() for p in parameters]).mean(0)  # what one group of all eight reaches
        spreads = [_spread(swarm_mean, parameters)]
        for _ in range(ROUNDS):
            outcomes, group_sizes = [None] * PEERS, [0] * PEERS

            def average(index: int) -> None:
                outer = peers[index].outer
                outcomes[index] = outer.outer_step([parameters[index]], weight=1.0, timeout=20.0)
                group_sizes[index] = outer.last_group_size
                outer.copy_to([parameters[index]])

            threads = [threading.Thread(target=average, args=(index,)) for index in range(PEERS)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=60)
            assert not any(thread.is_alive() for thread in threads), "a round never ended"
            averaged = [size for outcome, size in zip(outcomes, group_sizes) if outcome]
            assert len(averaged) >= PEERS // 2, f"most peers found no group: {outcomes}"
            assert all(size <= GROUP_SIZE for size in group_sizes), group_sizes  # the cap held: no group of more
            # whole groups averaged with equal weights: the swarm's mean is still the single group's result
            assert torch.allclose(torch.stack([p.detach() for p in parameters]).mean(0), swarm_mean, atol=1e-4)
            spreads.append(_spread(swarm_mean, parameters))
        # Averaging a group never moves its members' squared distances to the mean up in sum: the spread cannot grow.
        assert all(later <= earlier + 1e-4 for earlier, later in zip(spreads, spreads[1:])), spreads
        # Pairs that never changed would stop at the first round's spread (about 0.7 of the start). hivemind pairs
        # peers by who asks whom first, so a pair sometimes meets again, but new pairs each halve their squared
        # spread: over the rounds the spread falls far below the first round's.
        assert spreads[-1] < 0.2 * spreads[0] and spreads[-1] < 0.3 * spreads[1], spreads
    finally:
        for peer in peers:
            peer.shutdown()
        for dht in reversed(dhts):
            dht.shutdown()


def test_sync_swarm_averages_gradients_and_state_in_groups():
    """hivemind.Optimizer forwards its averager options to the state averager only: the gradient averager, which
    averages every swarm epoch, must get the cap too, or a grouped run would still all-reduce its gradients in one
    group of everyone."""
    config = get_preset("demo")
    options = HivemindOptions(run_id="test_sync_groups", target_batch_size=64, batch_size=16, matchmaking_time=1.0,
                              target_group_size=4)
    dht = start_dht(DHTOptions(host_maddrs=LOOPBACK))
    optimizer = None
    try:
        model = create_model(config.model, seed=config.seed)
        optimizer = wrap_optimizer(options, dht, *make_optimizer(model, config.optim), RSAPrivateKey())
        for averager in (optimizer.grad_averager, optimizer.state_averager):
            assert averager.matchmaking_kwargs["target_group_size"] == 4, type(averager).__name__
    finally:
        if optimizer is not None:
            optimizer.shutdown()
        dht.shutdown()
