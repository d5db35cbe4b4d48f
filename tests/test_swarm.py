"""A coordinator and volunteer peers, each its own process on loopback, train the demo preset together; the
coordinator records what they publish, validates the shared model and keeps the best checkpoint in S3."""

import json
import re
import subprocess
import sys
import time

import pytest
import torch

from conftest import BUCKET, ROOT, Process, start_coordinator
from hivetrain.config import get_preset
from hivetrain.metrics_store import MetricsReader
from hivetrain.model import create_model, load_weights
from hivetrain.roles.peers.progress import parameter_digest

STOP_AT = 20  # A and B leave here. C starts after epoch 3 and needs a few epochs to import and load the state
# C trains past A and B: on two busy cores its start can take as long as their whole run (CI: it joined at STOP_AT and
# had nothing left to train), and then it goes on alone from the state it downloaded.
C_STOP_AT = STOP_AT + 2
EPOCH_LINE = re.compile(r"swarm epoch (\d+) .* loss ([0-9.]+) \| params (\w+)")


def _epoch_lines(process: Process) -> list[tuple[int, float, str]]:
    return [(int(m.group(1)), float(m.group(2)), m.group(3)) for line in process.lines if (m := EPOCH_LINE.search(line))]


@pytest.fixture(scope="module")
def swarm_run(tmp_path_factory, s3):
    """Peers A and B train to swarm epoch STOP_AT; C joins once the swarm has passed epoch 3 and trains to C_STOP_AT."""
    tmp = tmp_path_factory.mktemp("swarm")
    started: list[Process] = []

    def spawn(name, *args, env=None):
        started.append(Process(list(args), tmp / f"{name}.log", env))
        return started[-1]

    try:
        coordinator, addresses = start_coordinator(spawn, tmp, "--preset", "demo", "--refresh", "1",
                                                   "--checkpoint-store", f"s3://{BUCKET}/swarm",
                                                   "--s3-endpoint-url", s3.endpoint_url)
        peers = {}
        for name in ("a", "b"):
            peers[name] = spawn(name, "peers/join.py", "--host", "127.0.0.1", "--initial-peers", *addresses, "--name", name, "--min-peers", "2",
                                "--threads", "1",
                                "--stop-at-epoch", str(STOP_AT), "--save-weights", str(tmp / f"{name}.safetensors"))
        peers["a"].wait_for(r"swarm epoch ([3-9]|\d\d) ", timeout=240)
        peers["c"] = spawn("c", "peers/join.py", "--host", "127.0.0.1", "--initial-peers", *addresses, "--name", "c", "--threads", "1",
                           "--stop-at-epoch", str(C_STOP_AT), "--save-weights", str(tmp / "c.safetensors"))
        codes = {name: peer.wait(timeout=300) for name, peer in peers.items()}
        yield tmp, peers, codes, s3
    finally:
        for process in reversed(started):
            process.stop()


def _load(path):
    config = get_preset("demo")
    model = create_model(config.model, seed=config.seed)
    epoch = int(load_weights(path, model)["epoch"])
    return epoch, torch.cat([p.detach().flatten() for p in model.parameters()])


def test_two_peers_train_and_average(swarm_run):
    tmp, peers, codes, _ = swarm_run
    assert codes["a"] == 0 and codes["b"] == 0, codes
    epoch_a, weights_a = _load(tmp / "a.safetensors")
    epoch_b, weights_b = _load(tmp / "b.safetensors")
    assert epoch_a >= 3 and epoch_b >= 3
    config = get_preset("demo")
    initial = torch.cat([p.detach().flatten() for p in create_model(config.model, seed=config.seed).parameters()])
    moved = (weights_a - initial).abs().max().item()
    # Averaged peers hold nearly the same weights (tests/test_averaging.py proves a swarm step exact in one process).
    # Here peers leave one by one, a third joins late, and on two busy cores some rounds are missed or formed by a
    # sub-group: each such round drifts them apart by about one Adam step (about lr per weight) until the next
    # parameter averaging. Peers that never averaged would be apart by about as much as they moved.
    apart = (weights_a - weights_b).abs().max().item()
    assert moved > 0.01
    assert apart < 0.25 * moved, (apart, moved)
    lines_a = _epoch_lines(peers["a"])
    losses = [loss for _, loss, _ in lines_a]
    assert losses[-1] < losses[0] * 0.8, losses


def test_late_joiner_downloads_current_state(swarm_run):
    tmp, peers, codes, _ = swarm_run
    assert codes["c"] == 0, codes
    start = peers["c"].wait_for(r"Starting at swarm epoch (\d+) \| params (\w+)", timeout=1)
    joined_at, digest = int(start.group(1)), start.group(2)
    # Before its first step C holds the swarm's epoch (>= 3, where A and B were) and trained parameters, not the
    # initial ones every peer builds. Its digest is not required to equal one that A or B printed: hivemind may
    # serve its state between a peer's optimizer step and its parameter averaging, a moment no progress line shows.
    assert joined_at >= 3
    config = get_preset("demo")
    assert digest != parameter_digest(create_model(config.model, seed=config.seed))
    # Then it trains, with the swarm and then alone, to its own end.
    epoch_c, _ = _load(tmp / "c.safetensors")
    assert epoch_c == C_STOP_AT
    # Its first epoch line continues from where it joined: the next epoch, or a later one when it missed its first
    # round and loaded the swarm's newer state (SwarmOptimizer reloads rather than drift); never back from scratch.
    epochs_c = [epoch for epoch, _, _ in _epoch_lines(peers["c"])]
    assert joined_at < epochs_c[0] <= joined_at + 3, (joined_at, epochs_c)
    assert epochs_c == sorted(epochs_c)


def _contributed(process: Process) -> int:
    return int(process.wait_for(r"contributed (\d+) samples", timeout=1).group(1))


def test_monitor_records_what_the_peers_published(swarm_run):
    tmp, peers, _, _ = swarm_run
    expected = {name: _contributed(peer) for name, peer in peers.items()}
    deadline = time.monotonic() + 30  # each peer's last record lands as it leaves; the monitor reads every second
    while True:
        with MetricsReader(tmp / "coordinator" / "metrics.sqlite") as reader:
            recorded = {row.name: row.samples for row in reader.peers()}
            snapshots = reader.snapshots()
        if recorded == expected or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert recorded == expected
    assert max(s.alive_peers for s in snapshots) >= 2
    # The monitor saw the swarm reach A's and B's last epoch; C's own last one it may miss, as C leaves the moment it
    # steps there alone.
    assert STOP_AT <= max(s.epoch for s in snapshots) <= C_STOP_AT
    assert list((tmp / "coordinator" / "tensorboard").glob("events.out.tfevents.*"))


def test_best_checkpoint_in_s3_reproduces_its_validation(swarm_run):
    tmp, _, _, s3 = swarm_run
    with MetricsReader(tmp / "coordinator" / "metrics.sqlite") as reader:
        validations, checkpoints, best = reader.validations(), reader.checkpoints(), reader.best_validation()
    epochs = [v.epoch for v in validations]
    assert len(epochs) >= 3 and epochs == sorted(set(epochs)), epochs
    assert validations[-1].top1 > validations[0].top1
    [best_checkpoint] = [c for c in checkpoints if c.best]
    assert best_checkpoint.uri.startswith(f"s3://{BUCKET}/swarm/") and best_checkpoint.epoch == best.epoch
    # The testing script on the stored best checkpoint, downloaded from S3, gives exactly the logged numbers.
    result = subprocess.run([sys.executable, "-m", "hivetrain.evaluate", "--checkpoint", f"s3://{BUCKET}/swarm",
                             "--s3-endpoint-url", s3.endpoint_url], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    metrics = json.loads(result.stdout)
    assert (metrics["epoch"], metrics["top1"], metrics["top5"], metrics["loss"]) == (
        best.epoch, best.top1, best.top5, best.loss)
