"""A diloco run on loopback: a coordinator and volunteer peers, each its own process, train the demo preset in DiLoCo
rounds; one peer dies mid-round, another joins late, and the coordinator validates, keeps the best checkpoint and
resumes a run from it."""

import json
import re

import pytest
import torch

from conftest import ROUND_LINE, Process, start_coordinator
from hivetrain.checkpoint_location import load_checkpoint
from hivetrain.config import get_preset
from hivetrain.metrics_store import MetricsReader
from hivetrain.model import create_model, load_weights

STOP_AT = 32  # rounds take about 2 s here: the late joiner, up within ~10 s, still trains several
DIES_AT = 3  # the outer round in which peer d dies
# The DiLoCo paper's outer step, so that the outer momentum travels with checkpoints and state downloads (the default,
# plain averaging, has none)
DILOCO = ("--preset", "demo", "--mode", "diloco", "--overlap-rounds", "--inner-steps", "8", "--outer-lr", "0.7",
          "--outer-momentum", "0.9")


@pytest.fixture(scope="module")
def diloco_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("diloco")
    started: list[Process] = []

    def spawn(name, *args):
        started.append(Process(list(args), tmp / f"{name}.log"))
        return started[-1]

    try:
        coordinator, addresses = start_coordinator(spawn, tmp, *DILOCO, "--refresh", "1")
        peers = {}
        common = ("--host", "127.0.0.1", "--initial-peers", *addresses, "--threads", "1")
        for name in ("a", "b"):
            peers[name] = spawn(name, "peers/join.py", *common, "--name", name, "--min-peers", "3",
                                "--stop-at-epoch", str(STOP_AT), "--save-weights", str(tmp / f"{name}.safetensors"),
                                "--events", str(tmp / f"{name}.events"))
            # one after the other: b takes a's state at its setup, then waits too (test_a_peer_that_took_...)
            peers[name].wait_for(r"Waiting for peers", timeout=120)
        peers["d"] = spawn("d", "tests/dying_peer.py", str(DIES_AT), *common, "--name", "d", "--min-peers", "3")
        peers["a"].wait_for(r"^swarm epoch ([1-9]|\d\d) ", timeout=240)  # c starts now, and joins rounds later
        peers["c"] = spawn("c", "peers/join.py", *common, "--name", "c", "--stop-at-epoch", str(STOP_AT),
                           "--save-weights", str(tmp / "c.safetensors"))
        codes = {name: peers[name].wait(timeout=300) for name in ("a", "b", "c")}
        codes["d"] = peers["d"].wait(timeout=30)
        yield tmp, coordinator, peers, codes, addresses
    finally:
        for process in reversed(started):
            process.stop()


def test_a_peer_that_took_the_state_and_waited_for_others_does_not_download_it_again(diloco_run):
    """b comes once a waits, and takes a's outer state at its setup; then it waits for d (--min-peers 3), and nobody
    steps before all three are there: b still holds the swarm's state when d arrives, and a second download (the
    model over a volunteer's link) would bring nothing."""
    _, _, peers, _, _ = diloco_run
    b = peers["b"]
    before_start = b.lines[:next(i for i, line in enumerate(b.lines) if "Starting at swarm epoch" in line)]
    downloads = [line for line in before_start if "hivemind_internals.downloads: Finished downloading state" in line]
    waited = next(i for i, line in enumerate(before_start) if "Waiting for peers" in line)
    assert downloads and before_start.index(downloads[0]) < waited  # its setup took a's state
    assert b.wait_for(r"Starting at swarm epoch (\d+)", timeout=1).group(1) == "0"  # nobody had stepped
    assert len(downloads) == 1, before_start


def test_peers_train_in_rounds_and_hold_the_same_outer_parameters(diloco_run):
    tmp, _, peers, codes, _ = diloco_run
    assert codes["a"] == 0 and codes["b"] == 0 and codes["c"] == 0, codes
    averaged = [int(m.group(1)) for line in peers["a"].lines if (m := ROUND_LINE.search(line))
                and m.group(2) == "averaged with the swarm"]
    assert len(averaged) >= STOP_AT // 2, peers["a"].lines
    weights, reached = {}, {}
    config = get_preset("demo")
    for name in ("a", "b", "c"):
        model = create_model(config.model, seed=config.seed)
        reached[name] = int(load_weights(tmp / f"{name}.safetensors", model)["epoch"])
        weights[name] = torch.cat([p.detach().flatten() for p in model.parameters()])
    initial = torch.cat([p.detach().flatten() for p in create_model(config.model, seed=config.seed).parameters()])
    moved = (weights["a"] - initial).abs().max().item()
    assert moved > 0.05
    # Peers whose last round was averaged in the same all-reduce hold the same outer parameters: all-reduce returns
    # each its own value plus the delta to the average, so they agree to float rounding, not always bit for bit. A
    # round's number can differ between its groupmates (one that lags a round joins the others' round and takes
    # their number, plus one), so the round an all-reduce brought them to tells its groupmates: the epoch they left
    # at. A peer that missed the last round took its own step; it would rejoin at the next one, but the run ends. So
    # would one whose last event was a load of the swarm's state: a round in flight, whose start it holds and whose
    # average it takes at the next round (one that lagged a round under a CI run's load left so, one round behind).
    last_rounds = {name: [m.groups() for line in peers[name].lines if (m := ROUND_LINE.search(line))][-1]
                   for name in ("a", "b", "c")}
    final = max(reached.values())
    together = [name for name, (_, outcome) in last_rounds.items()
                if reached[name] == final and outcome == "averaged with the swarm"]
    assert len(together) >= 2, (last_rounds, reached)
    for name in together[1:]:
        torch.testing.assert_close(weights[name], weights[together[0]], rtol=0, atol=1e-5)
    apart = {name: (weights[name] - weights[together[0]]).abs().max().item() for name in weights}
    assert max(apart.values()) < 0.1 * moved, apart  # one lone step at most: nobody drifted away


def test_peers_train_while_their_rounds_are_in_flight(diloco_run):
    """Overlapped rounds: each landed round counts the inner steps its peer took while it ran, and the peer published
    its waits for rounds apart from the rounds' time in the background."""
    tmp = diloco_run[0]
    for name in ("a", "b"):
        events = [json.loads(line) for line in (tmp / f"{name}.events").read_text().splitlines()]
        overlapped = [e["overlapped_steps"] for e in events if e["event"] == "epoch" and e["overlapped_steps"]]
        assert len(overlapped) >= STOP_AT // 2, events  # most rounds ran beside inner steps
        left = next(e for e in events if e["event"] == "left")
        assert left["communication_seconds"] > 0 and 0 <= left["wait_seconds"] <= left["swarm_seconds"]


def test_a_peer_killed_mid_round_does_not_stop_the_others(diloco_run):
    _, _, peers, codes, _ = diloco_run
    died = peers["d"].wait_for(r"Dying in outer round (\d+), stage RUNNING_ALLREDUCE", timeout=1)
    # killed mid-all-reduce in the first round it averaged from DIES_AT on (a round it spent alone or skipped by
    # loading the swarm's state has no all-reduce to die in)
    assert int(died.group(1)) >= DIES_AT and codes["d"] == -9
    epochs_a = [int(m.group(1)) for line in peers["a"].lines if (m := re.match(r"swarm epoch (\d+) ", line))]
    assert epochs_a[-1] == STOP_AT and epochs_a == sorted(epochs_a)


def test_a_late_joiner_continues_from_the_swarms_round(diloco_run):
    _, _, peers, _, _ = diloco_run
    joined_at = int(peers["c"].wait_for(r"Starting at swarm epoch (\d+)", timeout=1).group(1))
    assert joined_at >= 1  # started after round 1: it took the swarm's round, not 0
    epochs_c = [int(m.group(1)) for line in peers["c"].lines if (m := re.match(r"swarm epoch (\d+) ", line))]
    assert epochs_c and joined_at < epochs_c[0] and epochs_c[-1] == STOP_AT


def test_the_coordinator_validates_and_resumes_the_outer_state(diloco_run, spawn, tmp_path):
    tmp, coordinator, _, _, _ = diloco_run
    top1 = [float(m.group(2)) for line in coordinator.lines
            if (m := re.match(r"validation at swarm epoch (\d+): top-1 ([\d.]+)", line))]
    assert len(top1) >= 3 and top1[-1] > top1[0] and max(top1) > 0.7, top1
    with MetricsReader(tmp / "coordinator" / "metrics.sqlite") as store:  # what the dashboard shows of the rounds
        recorded = {row.name: row for row in store.peers()}
    for name in ("a", "b", "c"):
        assert recorded[name].pseudo_gradient_norm > 0 and recorded[name].inner_steps is not None
    # a peer whose last round was averaged sent at least the demo model's parameters, float32 (a group of 2 or more)
    assert max(recorded[name].round_bytes for name in ("a", "b", "c")) >= 497_034 * 4
    checkpoint = load_checkpoint(tmp / "coordinator" / "checkpoints")
    assert checkpoint.config.swarm.mode == "diloco" and checkpoint.epoch >= 3
    momentum = checkpoint.optimizer["state"][0]["momentum_buffer"]
    assert momentum.abs().max() > 0  # the outer momentum travels with the checkpoint
    # A new run resumed from that checkpoint serves its round, outer parameters and momentum to its first joiner.
    _, addresses = start_coordinator(spawn, tmp_path, *DILOCO, "--resume", str(tmp / "coordinator" / "checkpoints"),
                                     "--validate-every", "0", name="resumed")
    joiner = spawn("joiner", "peers/join.py", "--host", "127.0.0.1", "--initial-peers", *addresses, "--threads", "1",
                   "--max-steps", "1", "--save-weights", str(tmp_path / "joiner.safetensors"))
    assert joiner.wait(timeout=120) == 0
    assert int(joiner.wait_for(r"Starting at swarm epoch (\d+)", timeout=1).group(1)) == checkpoint.epoch
