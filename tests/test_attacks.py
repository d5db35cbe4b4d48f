"""A malicious volunteer in a diloco run on loopback: three honest peers and one (benchmarks/attacker.py) that sends its
pseudo-gradient x1000 in every round. Without a defence the honest peers' model is ruined; with centered-clip inside
the all-reduce it keeps training (over 70% top-1 on the held-out digits after three rounds)."""

import re

import pytest
import torch

from benchmarks.attacker import Contribution
from conftest import ROUND_LINE, Process, start_coordinator
from hivetrain.config import get_preset
from hivetrain.data import make_datamodule
from hivetrain.evaluate import evaluate
from hivetrain.model import create_model, load_weights

STOP_AT = 3  # outer rounds, about 6 s each for four peers on two cores: one averaged round already tells
ATTACK = "scale:1000"
HONEST = ("a", "b", "c")
# Four peers on two busy cores notice that a round is due up to ~2 s apart: with the demo's 1 s of matchmaking they
# split into two groups of two, and an honest peer that never shared a group with the attacker escaped it (seen one
# run in three). A 3 s window holds all four in one group.
DILOCO = ("--preset", "demo", "--mode", "diloco", "--inner-steps", "8", "--validate-every", "0",
          "--matchmaking-time", "3")


def _top1(path) -> float:
    config = get_preset("demo")
    model = create_model(config.model, seed=config.seed)
    load_weights(path, model)
    if not all(torch.isfinite(p).all() for p in model.parameters()):
        return 0.0  # the attack blew the parameters up: no prediction means anything
    data = make_datamodule(config, batch_size=256)
    data.prepare_data()
    data.setup()
    return evaluate(model, data.val_dataloader())["top1"]


@pytest.fixture(scope="module", params=["none", "centered-clip"])
def attacked_run(request, tmp_path_factory):
    defence = request.param
    tmp = tmp_path_factory.mktemp(f"attack-{defence}")
    started: list[Process] = []

    def spawn(name, *args):
        started.append(Process(list(args), tmp / f"{name}.log"))
        return started[-1]

    try:
        coordinator, addresses = start_coordinator(spawn, tmp, *DILOCO, "--robust-aggregation", defence)
        common = ("--host", "127.0.0.1", "--initial-peers", *addresses, "--threads", "1", "--min-peers", "4",
                  "--stop-at-epoch", str(STOP_AT))
        peers = {name: spawn(name, "peers/join.py", *common, "--name", name,
                             "--save-weights", str(tmp / f"{name}.safetensors")) for name in HONEST}
        peers["attacker"] = spawn("attacker", "benchmarks/attacker.py", ATTACK, *common, "--name", "attacker")
        codes = {name: peer.wait(timeout=240) for name, peer in peers.items()}
        yield defence, tmp, coordinator, peers, codes
    finally:
        for process in reversed(started):
            process.stop()


def test_one_attacker_in_four(attacked_run):
    defence, tmp, coordinator, peers, codes = attacked_run
    assert all(code == 0 for code in codes.values()), codes
    announced = [line for line in coordinator.lines if line.startswith("Robust aggregation: ")]
    expected = "Robust aggregation: centered-clip (clip radius 0.25) in every all-reduce"
    assert announced == ([] if defence == "none" else [expected])
    # It took part: a round it attacked was averaged with the swarm, so the outcome below is its doing. On two busy
    # cores it can fall a round behind and load the swarm's state instead of attacking (CI, stop 42: one attack in
    # three rounds), so one averaged attack is what the test asks for.
    log = peers["attacker"].lines
    attacked = {int(m.group(1)) for line in log if (m := re.match(r"Attack: \S+ on outer round (\d+)", line))}
    averaged = {int(m.group(1)) for line in log
                if (m := ROUND_LINE.search(line)) and m.group(2) == "averaged with the swarm"}
    assert attacked & averaged, "\n".join(log)
    top1 = {name: _top1(tmp / f"{name}.safetensors") for name in HONEST}
    if defence == "none":
        assert max(top1.values()) < 0.3, top1  # the attack works: near chance (10 classes) or blown up
    else:
        assert min(top1.values()) > 0.7, top1


def test_each_attack_replaces_a_contribution_as_named():
    generator = torch.Generator().manual_seed(1)  # not the attack's own seed (0): its noise would be these values
    rounds = [[torch.randn(5, 3, generator=generator), torch.randn(7, generator=generator)] for _ in range(2)]
    scaled = Contribution("scale:-10")(rounds[0])
    assert all(torch.equal(a, -10 * h) for a, h in zip(scaled, rounds[0]))
    noise = Contribution("noise")(rounds[0])
    for a, h in zip(noise, rounds[0]):
        assert a.norm().item() == pytest.approx(h.norm().item(), rel=1e-5)
        assert torch.nn.functional.cosine_similarity(a.flatten(), h.flatten(), dim=0).abs() < 0.9
    replay = Contribution("replay")
    replay(rounds[0])
    assert all(torch.equal(a, h) for a, h in zip(replay(rounds[1]), rounds[0]))  # the first round, again
    with pytest.raises(ValueError, match="unknown attack"):
        Contribution("flip")


def test_an_attack_starts_at_its_round_or_once_its_trigger_file_exists(tmp_path):
    from_round = Contribution("scale:1000@3")
    assert [from_round.started(r) for r in range(5)] == [False, False, False, True, True]
    trigger = tmp_path / "go"
    triggered = Contribution(f"noise@{trigger}")
    assert triggered.spec == "noise" and not triggered.started(0) and not triggered.started(7)
    trigger.touch()
    assert triggered.started(8)
    trigger.unlink()
    assert triggered.started(9)  # from then on
    assert Contribution("replay").started(0)


def test_the_sync_attack_replaces_the_gradients_a_peer_loads_for_averaging(monkeypatch):
    from hivemind.optim.grad_averager import GradientAverager

    from benchmarks.attacker import attack_sync
    from hivetrain.hivemind_internals import PatchedOptimizer
    from hivetrain.swarm import DHTOptions, start_dht

    # attack_sync sets the optimizer's gradient averager class for the whole process, as in the attacker's: undone
    # after this test. hivemind's own class is left as it is.
    monkeypatch.setattr(PatchedOptimizer, "gradient_averager_class", PatchedOptimizer.gradient_averager_class)
    honest_load = GradientAverager.load_accumulators_into_averager_
    attack_sync(Contribution("scale:-10"))
    assert GradientAverager.load_accumulators_into_averager_ is honest_load
    attacker_class = PatchedOptimizer.gradient_averager_class
    assert attacker_class.__name__ == "GradientAverager"  # the honest peers average with it under hivemind's name
    dht = start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    parameter = torch.nn.Parameter(torch.zeros(6))
    parameter.grad = torch.arange(6.0)
    averager = attacker_class([parameter], dht=dht, prefix="attack_sync_test", start=True)
    try:
        averager.accumulate_grads_(batch_size=4)
        averager.load_accumulators_into_averager_()
        with averager.get_tensors() as [sent]:
            assert torch.equal(sent, -10 * torch.arange(6.0))
    finally:
        averager.shutdown()
        dht.shutdown()
