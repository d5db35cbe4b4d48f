"""The coordinator's /metrics (Prometheus text format) and /api/state (JSON), scraped from a live run: a coordinator
and one peer on loopback, read as Prometheus and a script would read them."""

import json
import time
import urllib.error
import urllib.request

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import start_coordinator

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
               and all(peer["samples"] > 0 for peer in state["peers"])):
        assert coordinator.popen.poll() is None, coordinator.lines
        assert time.monotonic() < deadline, f"no trained peer and validation within 120 s: {state}"
        time.sleep(1)

    (peer,) = state["peers"]
    assert peer["name"] == NAME and not peer["left"] and peer["samples_per_second"] > 0
    assert 0 <= state["validation"]["top1"] <= 1 and state["validation"]["loss"] > 0
    assert state["rounds"] is None  # a sync run has no diloco rounds

    metrics = _metrics(url)
    assert [sample.value for sample in metrics["hivetrain_alive_peers"]] == [state["swarm"]["alive_peers"]]
    (samples,) = metrics["hivetrain_peer_samples"]
    assert samples.labels == dict(peer_id=peer["peer_id"], name=NAME) and samples.value >= peer["samples"] > 0
    assert [(s.labels["name"], s.value) for s in metrics["hivetrain_peer_left"]] == [(NAME, 0)]
    assert [s.labels["name"] for s in metrics["hivetrain_peer_samples_per_second"]] == [NAME]
    assert [s.labels["name"] for s in metrics["hivetrain_peer_last_seen_timestamp_seconds"]] == [NAME]
    assert metrics["hivetrain_swarm_epoch"][0].value >= state["validation"]["epoch"] >= 1
    assert 0 <= metrics["hivetrain_validation_top1"][0].value <= 1
    assert metrics["hivetrain_run"][0].labels["preset"] == "demo"
    assert "hivetrain_rounds" not in metrics
