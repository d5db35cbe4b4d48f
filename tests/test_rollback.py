"""Rollback to the best validated state (hivetrain.rollback): the record a peer obeys, and a run that needs one.

The unit test runs real DHT nodes on loopback: a coordinator that signs a genuine record, a forger that writes under
the same key with its own key, unsigned and malformed, and a peer that must act on the genuine record only. The
end-to-end test runs a coordinator with --rollback-drop and two demo peers, in each swarm mode, one of which turns
attacker once the coordinator has validated a good state (benchmarks/attacker.py): the coordinator's validation sees
top-1 collapse, serves the best checkpoint again, and both peers take it and say so.
"""

import logging
import math
import re
import time

import hivemind
import pytest
import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from conftest import publisher_identity, start_coordinator
from hivetrain.roles.coordinator.validator import Validator
from hivetrain.checkpoint import Checkpoint, LocalCheckpointStore, checkpoint_name, read_checkpoint
from hivetrain.config import get_preset
from hivetrain.data import make_datamodule
from hivetrain.metrics_store import MetricsReader, MetricsWriter
from hivetrain.model import create_model
from hivetrain.rollback import RollbackRecord, RollbackWatcher, publish_rollback, read_rollback, rollback_key
from hivetrain.run_record import fetch_run, publish_run_config
from hivetrain.swarm import DHTOptions, start_dht
from hivetrain.roles.peers.progress import parameter_digest

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def _record(run_id: str, sequence: int, round_: int = 12) -> RollbackRecord:
    return RollbackRecord(run_id=run_id, sequence=sequence, epoch=4, top1=0.8, round=round_,
                          reason="top-1 fall to 9.0%", time=time.time())


def _skips(caplog, key: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and r.getMessage().startswith(f"Skipping a record under {key}")]


def test_a_peer_obeys_only_the_coordinators_signed_rollback(caplog):
    config = get_preset("demo").replace(run_id="rollback-unit")
    key = rollback_key(config.run_id)
    coordinator = start_dht(DHTOptions(host_maddrs=LOOPBACK, identity_path=publisher_identity()))
    addresses = [str(a) for a in coordinator.get_visible_maddrs()]
    forger_key = RSASignatureValidator(RSAPrivateKey())
    forger = hivemind.DHT(initial_peers=addresses, host_maddrs=LOOPBACK, record_validators=[forger_key], start=True)
    peer = start_dht(DHTOptions(host_maddrs=LOOPBACK, initial_peers=addresses))
    watcher = None
    try:
        assert publish_run_config(coordinator, config)
        run = fetch_run(peer, config.run_id, addresses, timeout=30)
        coordinator_key = run.signer
        assert run.config == config and coordinator_key == RSASignatureValidator().local_public_key
        assert run.coordinator == coordinator.peer_id.to_base58()
        expires = get_dht_time() + 30
        # A validly signed record under the forger's own key, one that does not parse, and one with no owner at all.
        assert forger.store(key, _record(config.run_id, 99, round_=50).dict(), expires,
                            subkey=forger_key.local_public_key)
        forger.store(key, {"sequence": "many"}, expires, subkey=b"no owner here")
        assert read_rollback(peer, config.run_id, coordinator_key) is None  # nothing from the coordinator yet
        # DHT.store answers with the last node's reply, the forger's node maybe: the reads below tell what landed
        publish_rollback(coordinator, _record(config.run_id, 1))
        with caplog.at_level(logging.WARNING, logger="hivetrain.record_guard"):
            deadline = time.monotonic() + 30
            while (genuine := read_rollback(peer, config.run_id, coordinator_key)) is None:
                assert time.monotonic() < deadline, "the coordinator's record never arrived"
                time.sleep(0.5)
            assert (genuine.sequence, genuine.round) == (1, 12)
            # the forged one, though newer, was skipped, with one warning for as many reads
            read_rollback(peer, config.run_id, coordinator_key)
            assert _skips(caplog, key) == [f"Skipping a record under {key}: not signed by the run's coordinator"]
            caplog.clear()

            watcher = RollbackWatcher(peer, config.run_id, coordinator_key, every=0.2).start()
            deadline = time.monotonic() + 30
            while (taken := watcher.take(round_=5)) is None:
                assert time.monotonic() < deadline, "the watcher never handed the record over"
                time.sleep(0.2)
            assert taken.sequence == 1
            assert watcher.take(round_=5) is None  # once per rollback

            # A second rollback whose state this peer already holds (it joined after it): stale, skipped once
            publish_rollback(coordinator, _record(config.run_id, 2, round_=12))
            deadline = time.monotonic() + 30
            while not _skips(caplog, key):
                assert watcher.take(round_=20) is None
                assert time.monotonic() < deadline, "the stale record was never seen"
                time.sleep(0.2)
            assert _skips(caplog, key) == [f"Skipping a record under {key}: stale: rollback 2 is to swarm epoch 12,"
                                           " this peer is at 20"]
            assert watcher.take(round_=5) is None
    finally:
        if watcher is not None:
            watcher.stop()
        for dht in (peer, forger, coordinator):
            dht.shutdown()


def test_a_restarted_coordinator_signs_with_the_same_key(spawn, tmp_path):
    """A peer obeys only rollback records signed by the key that signed the run record it joined with: a coordinator
    restarted with the same identity signs with the same key (its identity's), or the peers that joined before the
    restart would skip its rollbacks."""
    signers = []
    for start in ("first", "restarted"):
        coordinator = spawn(start, "coordinator/start.py", "--host", "127.0.0.1", "--port", "0", "--identity",
                            str(tmp_path / "coordinator.key"), "--log-dir", str(tmp_path / "coordinator"),
                            "--validate-every", "0")
        addresses = coordinator.wait_for(r"peers/join.py --initial-peers (.+)$", timeout=90).group(1).split()
        peer = start_dht(DHTOptions(host_maddrs=LOOPBACK, initial_peers=addresses))
        try:
            signers.append(fetch_run(peer, None, addresses, timeout=30).signer)
        finally:
            peer.shutdown()
            coordinator.stop()
    assert signers[0] == signers[1]
    assert (tmp_path / "coordinator.key").stat().st_mode & 0o077 == 0  # its owner's only



DROP = 20  # top-1 points: the attacked model falls to about chance (10%)
# The attacker plays honest until the coordinator has validated a best state well above chance (its trigger file:
# benchmarks/attacker.py ATTACK@PATH). Three honest rounds raced the coordinator: demo rounds of under a second had
# passed them before its first validation, which saw the attacked model at chance, with nothing to fall from.
GOOD_BEST_LINE = r"^validation at swarm epoch \d+: top-1 (0\.[5-9]|1\.0)\d*, .* \(best so far\)$"  # top-1 >= 0.5
ROLLBACK_LINE = (r"^Rollback (\d+): validation at swarm epoch (\d+) saw top-1 fall to ([\d.]+)%; the swarm goes back to"
                 r" the best validated state \(swarm epoch (\d+), top-1 ([\d.]+)%\), served as swarm epoch (\d+)$")


# diloco: the pseudo-gradient x1000. sync: the gradients x-10 (AdamW divides by the gradients' own scale, so x1000
# would mostly train on; x-10 ascends the loss). diloco on two devices: the honest peer trains on two CPU processes
# (DDP), its rank 0 watches for the rollback and both ranks take it.
DILOCO = ["--mode", "diloco", "--inner-steps", "16"]
MODES = {"diloco": (DILOCO, "scale:1000", []),
         "sync": (["--mode", "sync"], "scale:-10", []),
         "diloco-2-devices": (DILOCO, "scale:1000", ["--devices", "2", "--device", "cpu"])}


@pytest.mark.parametrize("mode", MODES)
def test_the_swarm_rolls_back_to_the_best_state_when_top1_collapses(spawn, tmp_path, mode):
    options, attack, honest_options = MODES[mode]
    coordinator, addresses = start_coordinator(
        spawn, tmp_path, "--preset", "demo", *options, "--validate-every", "1", "--rollback-drop", str(DROP),
        "--threads", "1")
    common = ("--host", "127.0.0.1", "--initial-peers", *addresses, "--threads", "1", "--min-peers", "2")
    peers = {"honest": spawn("honest", "peers/join.py", *common, "--name", "honest", *honest_options,
                             events=tmp_path / "honest.jsonl"),
             "attacker": spawn("attacker", "benchmarks/attacker.py", f"{attack}@{tmp_path / 'attack'}", *common,
                               "--name", "attacker", events=tmp_path / "attacker.jsonl")}
    coordinator.wait_for(GOOD_BEST_LINE, timeout=150)
    (tmp_path / "attack").touch()
    first = coordinator.wait_for(ROLLBACK_LINE, timeout=150)
    published_at = time.monotonic()
    assert float(first.group(3)) < float(first.group(5)) - DROP
    assert int(first.group(4)) < int(first.group(2)) < int(first.group(6))  # best < seen < restored
    for name, peer in peers.items():
        # Each takes a rolled-back state and says so. The attacker ruins every later round, and a peer that was
        # already past a restored epoch when it saw the record skips it: then it takes the next rollback.
        taken = peer.wait_for_event("rollback", timeout=90)
        line = peer.wait_for(r"^Rolled back to the best validated state .*$", timeout=10).group(0)
        # the target (a benchmark, not asserted: two cores shared with other suites): back to training within
        # one validation interval plus 10 s of the validation
        print(f"{name}: rolled back {time.monotonic() - published_at:.1f} s after the coordinator's first rollback")
        rollback = coordinator.wait_for(ROLLBACK_LINE.replace(r"^Rollback (\d+)", f"^Rollback ({taken['sequence']})"),
                                        timeout=10)
        served, restored = int(rollback.group(6)), taken["epoch"]
        best = read_checkpoint(tmp_path / "coordinator" / "checkpoints" / checkpoint_name(int(rollback.group(4))))
        digest = re.search(r"\| params (\w+)$", line).group(1)
        assert line == (f"Rolled back to the best validated state (swarm epoch {rollback.group(4)}, top-1"
                        f" {rollback.group(5)}%): the coordinator saw top-1 fall to {rollback.group(3)}% | now at"
                        f" swarm epoch {restored} | params {digest}"), (name, line)
        assert restored >= served, (name, line)
        best_digest = parameter_digest(best.build_model())
        if restored == served:  # the coordinator's state itself
            assert digest == best_digest, (name, line)
        elif restored != served + 1 or digest != best_digest:
            # Not the best state one epoch on (hivemind's load catching this peer up with the swarm's epoch, one
            # ahead where the other sync peer had stepped, as in a CI run). A peer that took the rollback before it
            # trained a round on alone (the attacker, in sync mode), and the coordinator's holder took that newer
            # state before serving this one: what that peer said it held.
            other = next(p for n, p in peers.items() if n != name)
            other.wait_for(rf"^(swarm epoch {restored} \||Rolled back .* now at swarm epoch {restored}) .*"
                           rf"\| params {digest}$", timeout=10)
    with MetricsReader(tmp_path / "coordinator" / "metrics.sqlite") as store:  # what the dashboard shows
        rollback = store.rollbacks()[0]
    assert (rollback.sequence, rollback.epoch, rollback.best_epoch, rollback.restored_epoch) == (
        1, int(first.group(2)), int(first.group(4)), int(first.group(6)))
    assert rollback.top1 < rollback.best_top1 - DROP / 100


class RecordingHolder:
    """The coordinator's state holder as the Validator sees it, holding a model that the test sets; roll_back puts
    the checkpoint's weights back, as the real holders do (those are exercised end to end above)."""

    def __init__(self):
        config = get_preset("demo")
        self.config, self.epoch, self.has_state = config, 0, True
        self.model = create_model(config.model, seed=config.seed)
        self.rolled_back: list[tuple[int, int]] = []  # (checkpoint epoch, served as)

    def load_from_peers(self) -> bool:
        return False

    def checkpoint(self, metrics):
        return Checkpoint.from_model(self.model, self.config, self.epoch, metrics)

    def roll_back(self, checkpoint, epoch: int) -> None:
        self.model.load_state_dict(checkpoint.weights)
        self.epoch = epoch
        self.rolled_back.append((checkpoint.epoch, epoch))


def test_the_validator_rolls_back_on_a_non_finite_loss_and_on_a_drop_beyond_the_setting(tmp_path):
    holder = RecordingHolder()
    loader = make_datamodule(holder.config, val_limit=64).val_dataloader()
    published: list[RollbackRecord] = []
    lines: list[str] = []
    with MetricsWriter(tmp_path / "metrics.sqlite") as writer:
        validator = Validator(holder, loader, writer, LocalCheckpointStore(tmp_path / "checkpoints"),
                              swarm_epoch=lambda: holder.epoch + 1, report=lines.append, rollback_drop=5,
                              publish_rollback=published.append)
        holder.epoch = 2
        best = validator.validate()  # the first validation is the best so far
        trained = [p.detach().clone() for p in holder.model.parameters()]
        with torch.no_grad():  # what a ruined swarm serves: the same weights, one of them NaN
            next(holder.model.parameters()).view(-1)[0] = float("nan")
        holder.epoch = 3
        assert math.isnan(validator.validate().loss)
        assert holder.rolled_back == [(2, 3 + 1 + 3)]  # the swarm's epoch (4) plus three
        assert all(torch.equal(p, q) for p, q in zip(holder.model.parameters(), trained))
        [record] = published
        assert (record.sequence, record.epoch, record.top1, record.round) == (1, 2, best.top1, 7)
        assert record.reason == "the validation loss turn nan"
        assert lines[-1] == (f"Rollback 1: validation at swarm epoch 3 saw the validation loss turn nan; the swarm goes"
                             f" back to the best validated state (swarm epoch 2, top-1 {best.top1:.1%}), served as"
                             f" swarm epoch 7")
        # Within the setting: no rollback. Beyond it: the next one, numbered on.
        validator.best_top1 = best.top1 + 0.04
        validator.validate()
        assert len(published) == 1
        validator.best_top1 = best.top1 + 0.06
        validator.validate()
        assert [r.sequence for r in published] == [1, 2] and published[1].reason == f"top-1 fall to {best.top1:.1%}"
    with MetricsReader(tmp_path / "metrics.sqlite") as store:
        assert [(r.sequence, r.epoch, r.best_epoch, r.restored_epoch) for r in store.rollbacks()] == [
            (1, 3, 2, 7), (2, 7, 2, 11)]
        assert math.isnan(store.rollbacks()[0].loss)
