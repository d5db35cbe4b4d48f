"""A coordinator and volunteer peers, each its own process on loopback, train the demo preset together."""

import re

import pytest
import torch

from conftest import Process, start_coordinator
from hivetrain.config import get_preset
from hivetrain.model import create_model, load_weights
from peers.progress import parameter_digest

STOP_AT = 40  # a peer alone races through epochs until it sees the others: leave room for C to join
EPOCH_LINE = re.compile(r"swarm epoch (\d+) .* loss ([0-9.]+) \| params (\w+)")


def _epoch_lines(process: Process) -> list[tuple[int, float, str]]:
    return [(int(m.group(1)), float(m.group(2)), m.group(3)) for line in process.lines if (m := EPOCH_LINE.search(line))]


@pytest.fixture(scope="module")
def swarm_run(tmp_path_factory):
    """Peers A and B train to swarm epoch STOP_AT; C joins once the swarm has passed epoch 3."""
    tmp = tmp_path_factory.mktemp("swarm")
    started: list[Process] = []

    def spawn(name, *args, env=None):
        started.append(Process(list(args), tmp / f"{name}.log", env))
        return started[-1]

    try:
        coordinator, addresses = start_coordinator(spawn, tmp, "--preset", "demo")
        peers = {}
        for name in ("a", "b"):
            peers[name] = spawn(name, "peers/join.py", "--host", "127.0.0.1", "--initial-peers", *addresses, "--name", name, "--min-peers", "2",
                                "--threads", "1",
                                "--stop-at-epoch", str(STOP_AT), "--save-weights", str(tmp / f"{name}.safetensors"))
        peers["a"].wait_for(r"swarm epoch ([3-9]|\d\d) ", timeout=240)
        peers["c"] = spawn("c", "peers/join.py", "--host", "127.0.0.1", "--initial-peers", *addresses, "--name", "c", "--threads", "1",
                           "--stop-at-epoch", str(STOP_AT), "--save-weights", str(tmp / "c.safetensors"))
        codes = {name: peer.wait(timeout=300) for name, peer in peers.items()}
        yield tmp, peers, codes
    finally:
        for process in reversed(started):
            process.stop()


def _load(path):
    config = get_preset("demo")
    model = create_model(config.model, seed=config.seed)
    epoch = int(load_weights(path, model)["epoch"])
    return epoch, torch.cat([p.detach().flatten() for p in model.parameters()])


def test_two_peers_train_and_average(swarm_run):
    tmp, peers, codes = swarm_run
    assert codes["a"] == 0 and codes["b"] == 0, codes
    epoch_a, weights_a = _load(tmp / "a.safetensors")
    epoch_b, weights_b = _load(tmp / "b.safetensors")
    assert epoch_a >= 3 and epoch_b >= 3
    config = get_preset("demo")
    initial = torch.cat([p.detach().flatten() for p in create_model(config.model, seed=config.seed).parameters()])
    moved = (weights_a - initial).abs().max().item()
    # Averaged peers hold the same weights. Peers leave one by one, so the last rounds may be ones that one of them
    # missed: allow two Adam steps (an Adam step moves each weight by at most about lr).
    assert moved > 0.01
    assert (weights_a - weights_b).abs().max().item() < 2 * config.optim.lr
    lines_a, lines_b = _epoch_lines(peers["a"]), _epoch_lines(peers["b"])
    # After an averaging round the two peers' parameters are bit-identical: same digest at the same epoch.
    digests_a = {epoch: digest for epoch, _, digest in lines_a}
    same = [epoch for epoch, _, digest in lines_b if epoch >= 3 and digests_a.get(epoch) == digest]
    assert same, f"A and B never held identical parameters at the same epoch: {lines_a} {lines_b}"
    losses = [loss for _, loss, _ in lines_a]
    assert losses[-1] < losses[0] * 0.8, losses


def test_late_joiner_downloads_current_state(swarm_run):
    tmp, peers, codes = swarm_run
    assert codes["c"] == 0, codes
    start = peers["c"].wait_for(r"Starting at swarm epoch (\d+) \| params (\w+)", timeout=1)
    joined_at, digest = int(start.group(1)), start.group(2)
    # Before its first step C holds the swarm's epoch (>= 3, where A and B were) and trained parameters, not the
    # initial ones every peer builds. Its digest is not required to equal one that A or B printed: hivemind may
    # serve its state between a peer's optimizer step and its parameter averaging, a moment no progress line shows.
    assert joined_at >= 3
    config = get_preset("demo")
    assert digest != parameter_digest(create_model(config.model, seed=config.seed))
    # Then it trains with the swarm to the end.
    epoch_c, _ = _load(tmp / "c.safetensors")
    assert epoch_c == STOP_AT
    assert [epoch for epoch, _, _ in _epoch_lines(peers["c"])][0] == joined_at + 1
