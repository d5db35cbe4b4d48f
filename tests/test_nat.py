"""A volunteer behind NAT (two network namespaces and a masquerading router the test builds) finds out by itself that
nobody can dial it, joins in client mode and contributes samples."""

import time

import pytest

from conftest import start_coordinator
from hivetrain.metrics_store import MetricsReader
from benchmarks.netns import NattedNamespace


@pytest.fixture
def nat():
    reason = NattedNamespace.unavailable()
    if reason:
        pytest.skip(reason)
    network = NattedNamespace(1).create()
    yield network
    network.delete()


def test_a_peer_behind_nat_joins_in_client_mode_by_itself(spawn, tmp_path, nat):
    _, addresses = start_coordinator(spawn, tmp_path, "--preset", "demo", "--host", nat.host_ip, "--refresh", "1")
    assert all(f"/ip4/{nat.host_ip}/" in address for address in addresses)
    peer = spawn("natted", "peers/join.py", "--initial-peers", *addresses, "--name", "natted", "--threads", "1",
                 "--stop-at-epoch", "2", prefix=nat.exec_prefix)
    assert peer.wait(timeout=240) == 0, peer.log
    # The coordinator tried to dial it back and could not: no route into the NAT.
    assert any(line.startswith("Not reachable: the coordinator could not dial this peer back") and nat.peer_ip in line
               for line in peer.lines), peer.lines
    assert next(line for line in peer.lines if line.startswith("Joined run")).endswith("client mode")
    contributed = int(peer.wait_for(r"contributed (\d+) samples", timeout=1).group(1))
    time.sleep(3)  # the monitor's next look
    with MetricsReader(tmp_path / "coordinator" / "metrics.sqlite") as reader:
        rows = {row.name: row for row in reader.peers()}
    assert rows["natted"].client_mode and rows["natted"].samples == contributed > 0
