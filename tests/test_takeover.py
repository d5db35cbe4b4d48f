"""One volunteer cannot take a public run over (issue 27): each test mounts one attack with a plain hivemind process
that signs its records with its own key, and shows what the honest roles do."""

import dataclasses
import time

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from conftest import publisher_identity
from coordinator.monitor import SwarmMonitor
from hivetrain.config import RunConfig, get_preset
from hivetrain.hivemind_internals import write_identity
from hivetrain.metrics_store import MetricsReader, MetricsWriter
from hivetrain.model import create_model, parameter_count
from hivetrain.run_record import RUN_KEY, RunRecord, fetch_run, publish_run_config, signer_peer_id
from hivetrain.swarm import DHTOptions, SwarmError, start_dht
from hivetrain.telemetry import PeerRecord, metrics_key, publish_peer_record

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
DECADE = 10 * 365 * 86400.0


@pytest.fixture
def cleanup():
    started = []
    yield started
    for dht in reversed(started):
        dht.shutdown()


def _addresses(dht: hivemind.DHT) -> list[str]:
    return [str(a) for a in dht.get_visible_maddrs()]


def _start_hijacker(tmp_path, initial_peers: list[str], config) -> hivemind.DHT:
    """A volunteer whose identity key also signs its records (so its records are pinned to its own peer ID, as a
    coordinator's are) and that publishes its own run record: another model and run, robust aggregation off, and a
    `time` ten years ahead, the shape that used to win every joiner."""
    key = RSAPrivateKey()
    write_identity(key, str(tmp_path / "hijacker.key"))
    signer = RSASignatureValidator(key)
    dht = hivemind.DHT(initial_peers=initial_peers, host_maddrs=LOOPBACK, record_validators=[signer],
                       identity_path=str(tmp_path / "hijacker.key"), start=True)
    record = RunRecord(run_id=config.run_id, config=config.to_json(), fingerprint=config.fingerprint,
                       time=time.time() + DECADE)
    assert dht.store(RUN_KEY, record.dict(), get_dht_time() + 60, subkey=signer.local_public_key)
    return dht


def test_a_joiner_believes_only_the_run_record_of_the_peer_it_was_told_to_join(tmp_path, cleanup, caplog):
    honest = get_preset("demo").replace(run_id="takeover-honest")
    demo = get_preset("demo")
    hijacked = demo.replace(run_id="takeover-hijacked", batch_size=demo.batch_size * 2,
                            swarm=dataclasses.replace(demo.swarm, robust_aggregation="none"))
    coordinator = start_dht(DHTOptions(host_maddrs=LOOPBACK, identity_path=publisher_identity()))
    cleanup.append(coordinator)
    assert publish_run_config(coordinator, honest)
    hijacker = _start_hijacker(tmp_path, _addresses(coordinator), hijacked)
    cleanup.append(hijacker)
    # The hijacker also claims the coordinator's own run id: same key, newer time, another model.
    same_id = hijacked.replace(run_id=honest.run_id)
    signer = RSASignatureValidator(RSAPrivateKey())
    forger = hivemind.DHT(initial_peers=_addresses(coordinator), host_maddrs=LOOPBACK, record_validators=[signer],
                          start=True)
    cleanup.append(forger)
    assert forger.store(RUN_KEY, RunRecord(run_id=same_id.run_id, config=same_id.to_json(),
                                           fingerprint=same_id.fingerprint, time=time.time() + DECADE).dict(),
                        get_dht_time() + 60, subkey=signer.local_public_key)
    joiner = start_dht(DHTOptions(host_maddrs=LOOPBACK, initial_peers=_addresses(coordinator)))
    cleanup.append(joiner)

    # Told the coordinator's address: the coordinator's run, whatever else the swarm holds.
    run = fetch_run(joiner, None, _addresses(coordinator), timeout=30)
    assert run.config == honest and run.coordinator == coordinator.peer_id.to_base58()
    assert signer_peer_id(run.signer) == coordinator.peer_id.to_base58()
    # Told a volunteer's address (the hijacker's): its own record is pinned to it, so the user trusted it by naming it;
    # --coordinator puts the trust back where it belongs.
    assert fetch_run(joiner, None, _addresses(hijacker), timeout=30).config == hijacked
    run = fetch_run(joiner, None, _addresses(hijacker), coordinator=coordinator.peer_id.to_base58(), timeout=30)
    assert run.config == honest
    # Told the forger's address: nothing it signed hashes to its peer ID, and the joiner refuses in one line.
    with pytest.raises(SwarmError, match=r"signed by none of the peers you named .*--coordinator PEER_ID"):
        fetch_run(joiner, honest.run_id, _addresses(forger), timeout=2)
    # Taking any record is a choice, with a warning: then the newest, whoever signed it, wins.
    with caplog.at_level("WARNING", logger="hivetrain.run_record"):
        run = fetch_run(joiner, honest.run_id, _addresses(forger), timeout=10, any_coordinator=True)
    assert run.config == same_id and run.coordinator is None
    assert [r.getMessage() for r in caplog.records if r.name == "hivetrain.run_record"] == [
        f"Run {honest.run_id} comes from a record nobody vouches for (--any-coordinator): its signer"
        f" ({signer_peer_id(signer.local_public_key)}) is not a peer you named"]


@pytest.mark.parametrize("model, message", [
    (dict(name="hf-hub:someone/model"), "is not a timm model name"),
    (dict(kwargs=dict(pretrained_cfg_overlay=dict(file="/etc/passwd"))), "'pretrained_cfg_overlay' is not one"),
    (dict(kwargs=dict(checkpoint_path="https://example.com/weights.pth")), "'checkpoint_path' is not one"),
    (dict(kwargs=dict(depth=10**6)), r"depth=1000000 is outside 0\.\.256"),
    (dict(img_size=10**6), "img_size must be"),
])
def test_a_run_record_cannot_point_volunteers_at_files_or_huge_models(model, message):
    """Finding 8: the model settings a run record carries are architecture settings within bounds, read before any
    model is built; a record that breaks them does not load (and readers skip it with one warning)."""
    raw = get_preset("demo").to_dict()
    raw["model"] = {**raw["model"], **model}
    with pytest.raises(ValueError, match=message):
        RunConfig.from_dict(raw)


def test_a_model_beyond_a_volunteers_means_is_refused_before_it_is_built():
    demo = get_preset("demo")
    huge = dataclasses.replace(demo.model, kwargs=dict(demo.model.kwargs, embed_dim=16384, depth=256))
    assert parameter_count(demo.model) == sum(p.numel() for p in create_model(demo.model).parameters())
    with pytest.raises(ValueError, match=r"has 824,701,108,234 parameters, over the 2,000,000,000"):
        create_model(huge)


def test_a_volunteer_cannot_overwrite_another_volunteers_row(tmp_path, cleanup, caplog):
    """Finding 6: a metrics record's peer_id is its writer's word. The monitor keeps one row per peer ID, written only
    by the key that first claimed it; an impostor's record under its own key is skipped, with one warning."""
    config = get_preset("demo").replace(run_id="takeover-rows")
    coordinator = hivemind.DHT(host_maddrs=LOOPBACK, start=True)
    cleanup.append(coordinator)
    honest = start_dht(DHTOptions(host_maddrs=LOOPBACK, initial_peers=_addresses(coordinator)))
    cleanup.append(honest)
    signer = RSASignatureValidator(RSAPrivateKey())
    impostor = hivemind.DHT(initial_peers=_addresses(coordinator), host_maddrs=LOOPBACK, record_validators=[signer],
                            start=True)
    cleanup.append(impostor)
    victim_id = honest.peer_id.to_base58()
    record = PeerRecord(peer_id=victim_id, name="alice", hardware="test CPU", client_mode=False, epoch=3,
                        samples_per_second=10.0, loss=0.5, samples=640, time=time.time())
    publish_peer_record(honest, config.run_id, record, wait=True)
    with MetricsWriter(tmp_path / "metrics.sqlite") as writer:
        monitor = SwarmMonitor(coordinator, config, writer)
        assert monitor.refresh().alive_peers == 1
        forged = record.copy(update=dict(name="mallory", samples=10**12, loss=0.0))
        assert impostor.store(metrics_key(config.run_id), forged.dict(), get_dht_time() + 60,
                              subkey=signer.local_public_key)
        with caplog.at_level("WARNING", logger="hivetrain.record_guard"):
            for _ in range(3):
                snapshot = monitor.refresh()
        assert snapshot.alive_peers == 1
    with MetricsReader(tmp_path / "metrics.sqlite") as reader:
        assert [(p.peer_id, p.name, p.samples) for p in reader.peers()] == [(victim_id, "alice", 640)]
    assert [r.getMessage() for r in caplog.records if "claims another peer's ID" in r.getMessage()] == [
        f"Skipping a record under {metrics_key(config.run_id)}: claims another peer's ID: {victim_id}"]
