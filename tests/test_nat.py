"""Volunteers behind NAT (two network namespaces and a masquerading router the test builds, per NAT): one finds out by
itself that nobody can dial it, joins in client mode and contributes samples; two, each behind its own NAT, average
their rounds (diloco's outer rounds, sync's gradient all-reduce) through the coordinator, which leads their
groups (hivetrain.roles.coordinator.relay)."""

import time

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.optim.progress_tracker import LocalTrainingProgress
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from conftest import same_parameters, start_coordinator
from hivetrain.config import get_preset
from hivetrain.metrics_store import MetricsReader
from hivetrain.model import create_model
from hivetrain.optimizer import make_optimizer
from hivetrain.roles.coordinator.relay import IDLE_LOOK_EVERY, GradientRelay, newest_epoch_samples
from hivetrain.swarm_optimizer import optimizer_recipe
from benchmarks.netns import NattedNamespace

pytestmark = pytest.mark.netns  # NAT namespaces of fixed subnets (conftest.py)


@pytest.fixture
def nat():
    reason = NattedNamespace.unavailable()
    if reason:
        pytest.skip(reason)
    network = NattedNamespace(1).create()
    yield network
    network.delete()


@pytest.fixture
def second_nat(nat):
    network = NattedNamespace(2).create()
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


ROUNDS = 6


def _train_behind_two_nats(spawn, tmp_path, nats, *options: str):
    """A coordinator of the demo preset with `options`, and two peers ("first", "second"), each behind one of `nats`,
    that train to swarm epoch ROUNDS in client mode; returns the coordinator and the peers, who have exited."""
    coordinator, addresses = start_coordinator(spawn, tmp_path, "--preset", "demo", *options, "--host", nats[0].host_ip,
                                               "--refresh", "1", events=tmp_path / "coordinator.events")
    peers = {name: spawn(name, "peers/join.py", "--initial-peers", *addresses, "--name", name, "--threads", "1",
                         "--min-peers", "2", "--stop-at-epoch", str(ROUNDS), prefix=network.exec_prefix,
                         events=tmp_path / f"{name}.events")
             for name, network in zip(("first", "second"), nats)}
    for name, peer in peers.items():
        assert peer.wait(timeout=300) == 0, peer.log
        assert next(line for line in peer.lines if line.startswith("Joined run")).endswith("client mode"), name
    return coordinator, peers


# Rounds of 8 inner steps, or paced in seconds, where the coordinator's group must form when the peers' searches aim
PACINGS = {"steps": ("--inner-steps", "8"), "seconds": ("--inner-steps", "8", "--round-seconds", "3")}


@pytest.mark.parametrize("pacing", PACINGS)
def test_two_peers_behind_nat_average_their_rounds_through_the_coordinator(spawn, tmp_path, nat, second_nat, pacing):
    coordinator, peers = _train_behind_two_nats(spawn, tmp_path, (nat, second_nat), "--mode", "diloco",
                                                *PACINGS[pacing])
    # Each peer averaged rounds with the other: the coordinator, which brought no parameters, is not counted
    rounds = {name: {event["epoch"]: event for event in peer.events("epoch")} for name, peer in peers.items()}
    together = [round_ for round_, event in rounds["first"].items()
                if event["group_size"] == 2 and rounds["second"].get(round_, {}).get("group_size") == 2]
    assert together, rounds
    # ...and came out of those rounds with the same outer parameters
    assert any(same_parameters(rounds["first"][r]["probe"], rounds["second"][r]["probe"]) for r in together), rounds
    relayed = [event for event in coordinator.events("relayed") if event["trainers"] == 2]
    assert len(relayed) >= len(together), relayed


def test_the_sync_relay_counts_an_epochs_samples_as_the_peers_trackers_do():
    """A peer steps once its tracker's estimate reaches the target, then stops training for the round, so its records
    may never show the target: the relay carries each record forward at its rate, as hivemind's tracker does (it used
    to wait for the records and missed rounds, 1 run in 3 of the test below). A rate or time that is not a finite
    number carries nothing forward."""
    def record(epoch, samples, rate, written):
        return LocalTrainingProgress(peer_id=b"peer", epoch=epoch, samples_accumulated=samples, samples_per_second=rate,
                                     time=written, client_mode=True)

    now = 1000.0
    honest = [record(2, 48, 10.0, now - 2), record(2, 48, 10.0, now - 2), record(1, 500, 10.0, now - 2)]
    assert newest_epoch_samples(honest, now) == (2, 136.0)  # 96 written, 20 more each since; epoch 1 not counted
    assert newest_epoch_samples([record(2, 48, float("inf"), now), record(2, 48, 10.0, float("nan"))], now) == (2, 96.0)
    assert newest_epoch_samples([record(2, 48, 10.0, now + 60)], now) == (2, 48.0)  # written "later": nothing added


def test_the_sync_relay_starts_its_averager_only_once_every_trainer_is_behind_nat(cleanup):
    """The sync relay's averager is a process of its own holding a copy of the gradients: a run with a trainer that
    can be dialled never needs it. It is started, from the relay's thread, the first time every trainer's progress
    record says client mode, and shut down with the relay."""
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=[RSASignatureValidator()],
                       start=True)  # as the coordinator's, it reads signed records
    cleanup.append(dht)
    config = get_preset("demo")
    param_groups, _, _ = optimizer_recipe(*make_optimizer(create_model(config.model, seed=0), config.optim))
    trainers = []
    for _ in range(2):  # two trainers, each signing its progress record as hivemind's peers do
        signer = RSASignatureValidator(RSAPrivateKey())
        trainers.append((signer, hivemind.DHT(initial_peers=[str(a) for a in dht.get_visible_maddrs()],
                                              host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=[signer],
                                              start=True)))
        cleanup.append(trainers[-1][1])

    def publish(*client_modes: bool) -> None:
        for (signer, node), client_mode in zip(trainers, client_modes):
            record = LocalTrainingProgress(peer_id=node.peer_id.to_bytes(), epoch=1, samples_accumulated=8,
                                           samples_per_second=1.0, time=get_dht_time(), client_mode=client_mode)
            assert node.store(f"{config.run_id}_progress", record.dict(), get_dht_time() + 60,
                              subkey=signer.local_public_key)

    lines = []
    publish(False, True)
    relay = GradientRelay.for_run(dht, config, param_groups, report=lines.append).start()
    try:
        time.sleep(3 * IDLE_LOOK_EVERY)
        assert relay.averager is None and lines == []  # one trainer can be dialled: it leads the rounds
        publish(True, True)
        deadline = time.monotonic() + 30
        while relay.averager is None and time.monotonic() < deadline:
            time.sleep(0.2)
        averager = relay.averager
        assert averager is not None and averager.is_alive() and averager.mode.name == "AUX"
        assert any(line.startswith("Relaying gradient rounds: every trainer is behind NAT") for line in lines), lines
    finally:
        relay.stop()
    averager.join(timeout=15)
    assert not averager.is_alive()


def test_two_sync_peers_behind_nat_average_their_gradients_through_the_coordinator(spawn, tmp_path, nat, second_nat):
    """Sync mode: each swarm epoch's gradient all-reduce, and the state averaging after it, need a peer that can be
    dialled to lead their groups. The coordinator leads both, reducing every part with nothing of its own, and the two
    peers step on the same averaged gradients: in step (the same parameters) at the epochs both reached, missing no
    round. (With no state round, a gradient round that missed one peer under load left the two apart for good: a CI
    run, and 1 of 2 runs here beside a busy core.)"""
    coordinator, peers = _train_behind_two_nats(spawn, tmp_path, (nat, second_nat), "--mode", "sync")
    epochs = {name: {event["epoch"]: event for event in peer.events("epoch")} for name, peer in peers.items()}
    both = sorted(set(epochs["first"]) & set(epochs["second"]))
    assert both, epochs
    assert all(same_parameters(epochs["first"][e]["probe"], epochs["second"][e]["probe"]) for e in both), epochs
    # averaged, not reloaded: a peer that misses a round loads the coordinator's state (the same for both, too)
    left = {name: peer.event("left") for name, peer in peers.items()}
    assert all(event["missed_rounds"] <= 1 for event in left.values()), left
    relayed = [event for event in coordinator.events("relayed") if event["trainers"] == 2]
    assert len(relayed) >= ROUNDS - 2, relayed
    relayed_state = [event for event in coordinator.events("relayed_state") if event["trainers"] == 2]
    assert len(relayed_state) >= ROUNDS - 2, relayed_state
