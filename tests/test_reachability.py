"""--client-mode auto asks the coordinator to dial a probe back; the answer decides client mode."""

import time

import pytest

from hivetrain.reachability import check_reachability, serve_dial_back
from hivetrain.swarm import DHTOptions, start_dht


@pytest.fixture(scope="module")
def coordinator():
    dht = start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    dht.run_coroutine(serve_dial_back)
    yield [str(a) for a in dht.get_visible_maddrs()]
    dht.shutdown()


def test_a_listening_peer_is_dialled_back(coordinator):
    result = check_reachability(coordinator, ["/ip4/127.0.0.1/tcp/0"])
    assert result.reachable is True, result.detail


def test_an_address_nobody_listens_on_is_not_reachable(coordinator):
    # As a peer behind NAT announcing its router's address: the coordinator's dial is refused. Each time after a
    # reachable peer was checked: a coordinator that dialled with a reused host found the peer through that earlier
    # one (about every other time, a few seconds later) and answered "reachable".
    for _ in range(3):
        assert check_reachability(coordinator, ["/ip4/127.0.0.1/tcp/0"]).reachable is True
        time.sleep(3)
        result = check_reachability(coordinator, ["/ip4/127.0.0.1/tcp/0"], announce_maddrs=["/ip4/127.0.0.1/tcp/9"])
        assert result.reachable is False and "connection refused" in result.detail, result.detail


def test_an_initial_peer_that_cannot_answer_leaves_it_unknown():
    plain = start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))  # a DHT peer without the dial-back handler
    try:
        result = check_reachability([str(a) for a in plain.get_visible_maddrs()], ["/ip4/127.0.0.1/tcp/0"])
    finally:
        plain.shutdown()
    assert result.reachable is None and "no initial peer answered" in result.detail, result.detail
