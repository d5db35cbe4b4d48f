"""The coordinator's /metrics (Prometheus text format) and /api/state (JSON), scraped from a live run: a coordinator
and one peer on loopback, read as Prometheus and a script would read them."""

import json
import time
import urllib.error
import urllib.request

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import assert_clean_error, start_coordinator
from hivetrain.roles.coordinator.metrics_api import LABEL_LENGTH, LEFT_PEERS_SHOWN, MetricsServer
from hivetrain.metrics_store import MetricsWriter, PeerRow

NAME = 'ana "the\\ peer"\u00e9'  # a quote, a backslash, non-ASCII: a volunteer's name is any text


def _get(url: str) -> tuple[str, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.headers.get_content_type(), response.read().decode()


def _state(url: str) -> dict:
    content_type, body = _get(f"{url}/api/state")
    assert content_type == "application/json"
    return json.loads(body)


def _metrics(url: str) -> dict[str, list]:
    """Samples by family name (a counter's family drops the `_total` its samples carry)."""
    content_type, text = _get(f"{url}/metrics")
    assert content_type == "text/plain"
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def test_metrics_and_state_of_a_live_run(spawn, tmp_path):
    coordinator, addresses = start_coordinator(spawn, tmp_path, "--preset", "demo", "--refresh", "1", "--threads", "1",
                                               "--val-limit", "64", "--metrics-port", "0",
                                               events=tmp_path / "coordinator.events")
    url = coordinator.wait_for_event("serving", timeout=10)["metrics_url"]
    port = int(url.rsplit(":", 1)[1])
    # on loopback unless --metrics-host says otherwise: the only socket listening on that port is 127.0.0.1's
    listening = [c.laddr for c in psutil.Process(coordinator.popen.pid).net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    assert url == f"http://127.0.0.1:{port}" and [address.ip for address in listening] == ["127.0.0.1"]
    with pytest.raises(urllib.error.HTTPError, match="404"):
        _get(f"{url}/elsewhere")
    assert _state(url)["run"]["preset"] == "demo"

    spawn("peer", "peers/join.py", "--host", "127.0.0.1", "--initial-peers", *addresses, "--threads", "1",
          "--name", NAME)
    deadline = time.monotonic() + 120
    while not ((state := _state(url))["swarm"] and state["swarm"]["alive_peers"] == 1 and state["validation"]
               and all(peer["samples"] > 0 and peer["samples_per_second"] > 0 for peer in state["peers"])):
        assert coordinator.popen.poll() is None, coordinator.lines
        assert time.monotonic() < deadline, f"no trained peer and validation within 120 s: {state}"
        time.sleep(1)

    (peer,) = state["peers"]
    assert peer["name"] == NAME and not peer["left"]
    assert 0 <= state["validation"]["top1"] <= 1 and state["validation"]["loss"] > 0
    assert state["rounds"] is None  # a sync run has no diloco rounds

    metrics = _metrics(url)
    assert [sample.value for sample in metrics["hivetrain_alive_peers"]] == [state["swarm"]["alive_peers"]]
    (samples,) = metrics["hivetrain_peer_samples"]
    assert samples.labels == dict(peer_id=peer["peer_id"], name=NAME) and samples.value >= peer["samples"] > 0
    assert [(s.labels["name"], s.value) for s in metrics["hivetrain_peer_left"]] == [(NAME, 0)]
    # a record may say 0 samples/s (a peer busy in a round or a download trains nothing between two records)
    assert [(s.labels["name"], s.value >= 0) for s in metrics["hivetrain_peer_samples_per_second"]] == [(NAME, True)]
    assert [s.labels["name"] for s in metrics["hivetrain_peer_last_seen_timestamp_seconds"]] == [NAME]
    # (not compared with the validation's epoch: the validator downloads the newest state, the monitor's epoch comes
    # from records up to 5 s old)
    assert metrics["hivetrain_swarm_epoch"][0].value >= state["swarm"]["epoch"] >= 1
    assert 0 <= metrics["hivetrain_validation_top1"][0].value <= 1
    assert metrics["hivetrain_run_info"][0].labels["preset"] == "demo"
    assert "hivetrain_rounds" not in metrics

    # A second coordinator asked for the same port says so in one line, before it joins any swarm.
    second = spawn("second", "coordinator/start.py", "--host", "127.0.0.1", "--port", "0", "--validate-every", "0",
                   "--identity", str(tmp_path / "second.key"), "--log-dir", str(tmp_path / "second"),
                   "--metrics-port", str(port))
    assert_clean_error(second, second.wait(timeout=60), rf"cannot serve metrics on 127\.0\.0\.1 port {port}: .*in use")


def test_departed_hostile_and_diloco_peers_as_served(tmp_path):
    """What the store holds, served: a peer that left stays a series with left = 1 for LEFT_PEERS_SHOWN, then drops
    out; a volunteer's name is cut and escaped, never breaks the format; the run's diloco rounds are summed over
    every peer it has seen, so the counter does not drop when a peer's series does."""
    now = time.time()
    hostile = 'x"} 1\nhivetrain_alive_peers 99\n# ' * 10

    def row(peer_id: str, name: str, left_at=None) -> PeerRow:
        return PeerRow(peer_id=peer_id, name=name, hardware="cpu", client_mode=False, epoch=4,
                       samples_per_second=float("nan") if left_at else 50.0, loss=None, samples=640, first_seen=now,
                       last_seen=now, round_bytes=1000, left_at=left_at, rounds_averaged=3,
                       rounds_alone=1, rounds_failed=0)

    with MetricsWriter(tmp_path / "metrics.sqlite") as writer:
        writer.upsert_peers([row("in", hostile), row("left-now", "b", left_at=now),
                             row("left-long-ago", "c", left_at=now - LEFT_PEERS_SHOWN - 1)])
        server = MetricsServer(writer.path, "127.0.0.1", 0)
        try:
            state, metrics = _state(server.url), _metrics(server.url)
        finally:
            server.close()

    peers = {p["peer_id"]: p for p in state["peers"]}
    assert {peer_id: p["left"] for peer_id, p in peers.items()} == {"in": False, "left-now": True}
    assert peers["in"]["name"] == hostile[:LABEL_LENGTH]
    assert peers["left-now"]["samples_per_second"] is None  # NaN is no JSON number
    assert state["rounds"] == dict(averaged=9, alone=3, failed=0) and state["round_bytes"] == 1000
    assert state["swarm"] is None and "hivetrain_alive_peers" not in metrics  # no look yet: nothing, not a made-up 0
    assert {(s.labels["peer_id"], s.labels["name"], s.value) for s in metrics["hivetrain_peer_left"]} == {
        ("in", hostile[:LABEL_LENGTH], 0), ("left-now", "b", 1)}
    assert [s.labels["peer_id"] for s in metrics["hivetrain_peer_samples_per_second"]] == ["in"]
    assert {(s.labels["outcome"], s.value) for s in metrics["hivetrain_rounds"]} == {
        ("averaged", 9), ("alone", 3), ("failed", 0)}
