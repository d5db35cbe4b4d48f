"""--client-mode auto asks the coordinator to dial a probe back; the answer decides client mode."""

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass

import psutil
import pytest
from hivemind.p2p import P2P, PeerID
from hivemind.utils.crypto import RSAPrivateKey

from hivetrain.access import RunAuthorizer, issue_grant
from hivetrain.reachability import CHECK_INTERVAL, DIAL_BACK, MAX_DIALS_AT_ONCE, MAX_QUEUED, check_reachability, \
    serve_dial_back
from hivetrain.swarm import DHTOptions, start_dht


@dataclass
class Coordinator:
    addresses: list[str]
    pid: int  # its DHT process, whose children are the p2pd processes


@pytest.fixture(scope="module")
def coordinator():
    dht = start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    dht.run_coroutine(serve_dial_back)
    yield Coordinator([str(a) for a in dht.get_visible_maddrs()], dht.pid)
    dht.shutdown()


def test_a_listening_peer_is_dialled_back(coordinator):
    result = check_reachability(coordinator.addresses, ["/ip4/127.0.0.1/tcp/0"])
    assert result.reachable is True, result.detail


def test_an_address_nobody_listens_on_is_not_reachable(coordinator):
    # As a peer behind NAT announcing its router's address: the coordinator's dial is refused. Each time after a
    # reachable peer was checked: a coordinator that dialled with a reused host found the peer through that earlier
    # one (about every other time, a few seconds later) and answered "reachable".
    for _ in range(3):
        assert check_reachability(coordinator.addresses, ["/ip4/127.0.0.1/tcp/0"]).reachable is True
        time.sleep(3)
        result = check_reachability(coordinator.addresses, ["/ip4/127.0.0.1/tcp/0"],
                                    announce_maddrs=["/ip4/127.0.0.1/tcp/9"])
        assert result.reachable is False, result.detail


def test_dial_backs_are_capped_per_caller_and_at_once_and_say_nothing_of_the_address(coordinator, takeover_rows):
    """The attack: 24 concurrent requests from one caller, then 20 callers at once, each asking to be dialled at an
    address that accepts and never answers (each dial then lasts its whole timeout). The coordinator dials the one
    caller once, runs at most MAX_DIALS_AT_ONCE probes, queues at most MAX_QUEUED checks, refuses the rest in one
    answer each, and tells nobody why a dial failed."""
    dht_process = psutil.Process(coordinator.pid)
    silent = socket.create_server(("127.0.0.1", 0), backlog=64)  # accepts, never speaks
    silent_address = f"/ip4/127.0.0.1/tcp/{silent.getsockname()[1]}"
    peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            probes = [p for p in dht_process.children(recursive=True) if p.name() == "p2pd"]
            peak[0] = max(peak[0], len(probes) - 1)  # its own p2pd is one
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        [one_caller] = asyncio.run(_ask(coordinator.addresses, silent_address, callers=1, requests=24))
        many_callers = [answer for [answer] in asyncio.run(_ask(coordinator.addresses, silent_address, callers=20))]
    finally:
        stop.set()
        watcher.join()
        silent.close()
    assert [answer for answer in one_caller if answer["reachable"] is not None] == [dict(reachable=False)], one_caller
    assert one_caller.count(dict(reachable=None, error=f"checked less than {CHECK_INTERVAL:g} s ago")) == 23
    assert many_callers.count(dict(reachable=False)) == MAX_QUEUED, many_callers
    assert many_callers.count(dict(reachable=None, error="busy with other checks")) == 20 - MAX_QUEUED
    assert 0 < peak[0] <= MAX_DIALS_AT_ONCE
    takeover_rows.add(7, "24 concurrent dial-back requests from one caller, then 20 callers at once, each naming an"
                         " address that accepts and never answers",
                      f"the one caller dialled once ({one_caller.count(dict(reachable=False))} answer, the rest"
                      f" refused); {many_callers.count(dict(reachable=False))} of 20 callers checked, the rest told"
                      f" \"busy\"; at most {peak[0]} probes at once")


async def _ask(coordinator: list[str], address: str, callers: int, requests: int = 1) -> list[list[dict]]:
    """`callers` libp2p hosts, started first, then `requests` dial-back requests from each at once, naming `address`:
    the answers, caller by caller."""
    hosts = await asyncio.gather(*(P2P.create(initial_peers=coordinator, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
                                   for _ in range(callers)))
    coordinator_id = PeerID.from_base58(coordinator[0].rsplit("/p2p/", 1)[-1])

    async def ask(host: P2P) -> dict:
        _, reader, writer = await host.call_binary_stream_handler(coordinator_id, DIAL_BACK)
        writer.write(json.dumps(dict(peer_id=host.peer_id.to_base58(), maddrs=[address])).encode() + b"\n")
        await writer.drain()
        return json.loads(await asyncio.wait_for(reader.readline(), 60))

    try:
        return await asyncio.gather(*(asyncio.gather(*(ask(host) for _ in range(requests))) for host in hosts))
    finally:
        await asyncio.gather(*(host.shutdown() for host in hosts))


def test_an_initial_peer_that_cannot_answer_leaves_it_unknown():
    plain = start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))  # a DHT peer without the dial-back handler
    try:
        result = check_reachability([str(a) for a in plain.get_visible_maddrs()], ["/ip4/127.0.0.1/tcp/0"])
    finally:
        plain.shutdown()
    assert result.reachable is None and "no initial peer answered" in result.detail, result.detail


def test_a_private_run_dials_back_only_a_grant_holder(tmp_path):
    # A coordinator anyone can reach must not be a free dialler for hosts outside its private run.
    authority = RSAPrivateKey()
    own = RSAPrivateKey()
    coordinator_grant = issue_grant(authority, "coordinator", 3600, holder=own, with_key=False)
    dht = start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                               authorizer=RunAuthorizer(coordinator_grant, holder=own)))
    try:
        dht.run_coroutine(serve_dial_back)
        addresses = [str(a) for a in dht.get_visible_maddrs()]
        nobody = check_reachability(addresses, ["/ip4/127.0.0.1/tcp/0"])
        assert nobody.reachable is None and "private" in nobody.detail, nobody.detail
        foreign = RunAuthorizer(issue_grant(RSAPrivateKey(), "eve", 3600))
        refused = check_reachability(addresses, ["/ip4/127.0.0.1/tcp/0"], authorizer=foreign)
        assert refused.reachable is None and "private" in refused.detail, refused.detail
        alice = RunAuthorizer(issue_grant(authority, "alice", 3600))
        result = check_reachability(addresses, ["/ip4/127.0.0.1/tcp/0"], authorizer=alice)
        assert result.reachable is True, result.detail
    finally:
        dht.shutdown()
