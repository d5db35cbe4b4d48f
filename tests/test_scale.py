"""The scale suite (benchmarks/scale.py measures, benchmarks/scale_fit.py fits, benchmarks/scale_page.py writes
the page; run by benchmarks.bench) at its smallest: one swarm of two peers, its costs and one joiner, and the page
fitted and extrapolated from that result; and the committed page, rendered again from its result."""

import json
import re
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from benchmarks import bench, scale_fit


def test_scale_smoke():
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench", "scale", "--smoke"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result_text, page = done.stdout[done.stdout.index("\n{\n") + 1:].split("\n}\n", 1)
    bench_result = json.loads(result_text + "\n}")
    assert bench_result["suite"] == "scale" and bench_result["command"] == "python -m benchmarks.bench scale --smoke"
    [swarm] = bench_result["result"]["costs"]
    assert swarm["peers"] == 2 and swarm["rounds"] >= 1 and 1 <= swarm["group_size_median"] <= 2
    assert swarm["round_bytes"] is not None and swarm["coordinator_cores"] > 0 and swarm["peer_background_cores"] > 0
    storm = bench_result["result"]["storm"]
    [joiner] = storm["storm"]
    assert 0 < joiner["state_loaded_s"] <= joiner["first_step_s"]
    # a coordinator that only monitors holds no state: the joiner's download was answered by a training peer
    assert storm["served"]["coordinator"] == 0
    assert sum(count for holder, count in storm["served"].items() if "-peer-" in holder) >= 1
    assert page.startswith("# Scale") and "2-core machine that every peer" in page and "\n| 2 |  | " in page
    for size in ("100", "1,000", "10,000"):
        assert f"\n| {size} |" in page
    assert "not measured" in page and "| a joiner storm on the state holders |" in page


def test_fit_and_crossing():
    assert scale_fit.fit([(1, 1.0), (3, 5.0)]) == pytest.approx((-1.0, 2.0))
    assert scale_fit.crossing(-1.0, 2.0, 9.0) == pytest.approx(5.0)
    assert scale_fit.crossing(1.0, 0.0, 9.0) is None  # a cost that does not grow never reaches a limit
    assert scale_fit.crossing(10.0, 1.0, 9.0) == 0.0


def test_the_committed_page_renders_again_from_its_result():
    """logbook/scale.md is exactly what benchmarks.scale_page writes from the result it names: a change to the page's
    code that changes its text is seen here, and the page then rebuilt (python -m benchmarks.bench scale --page)."""
    page = (ROOT / "logbook" / "scale.md").read_text()
    result_path = ROOT / re.search(r"from the bench result `([^`]+)`", page).group(1)
    assert bench.render("scale", json.loads(result_path.read_text()), result_path, ROOT / "logbook") == page
    assert [line for line in page.splitlines() if line.startswith("#")] == [
        "# Scale: what each peer costs, and joiner storms", "## Measured: swarms of training peers",
        "## Measured: the coordinator's look with lightweight publishers", "## Measured: a joiner storm", "## Fits",
        "## Extrapolated to 100, 1,000 and 10,000 peers", "## Each limit, where it comes, and what lifts it",
        "## The coordinator as a relay for unreachable peers"]

def test_a_state_holder_counts_the_downloads_it_answers():
    """The counter behind the storm's figures: a download from the coordinator's holder counts one there."""
    import hivemind

    from hivetrain.roles.coordinator.state import StateHolder
    from hivetrain.config import get_preset

    config = get_preset("demo")
    dht = hivemind.DHT(start=True)
    other_dht = hivemind.DHT(initial_peers=[str(a) for a in dht.get_visible_maddrs()], start=True)
    holder = StateHolder(dht, config)
    other = StateHolder(other_dht, config)
    try:
        holder._offer(3)  # it holds the state of epoch 3 and serves it
        assert holder.states_served == 0
        deadline = time.monotonic() + 30
        while not other.load_from_peers():  # until its offer is in the DHT: no holder is asked before that
            assert time.monotonic() < deadline, "the holder's offer never reached the other"
            time.sleep(0.5)
        assert other.epoch == 3
        assert holder.states_served == 1 and other.states_served == 0
    finally:
        other.shutdown()
        holder.shutdown()
        other_dht.shutdown()
        dht.shutdown()
