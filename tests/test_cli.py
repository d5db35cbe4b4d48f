"""Bad input gets a clear one-line error and a non-zero exit, never a hang; the coordinator keeps its address."""

import dataclasses
import json
import os
import signal
import time

import pytest

from conftest import Process, assert_clean_error, dht_entries, record_reader, start_coordinator
from s3server import free_ports
from hivetrain.config import RunConfig, get_preset
from hivetrain.run_record import fetch_run
from hivetrain.swarm import INITIAL_PEERS_ENV, DHTOptions

SOME_PEER_ID = "QmPvRCVMx1ta4Dzn6fqTNXNjong7wbDRiwKgjtUMPT4UTx"


def _free_port() -> int:
    return free_ports(1)[0]


@pytest.fixture(scope="module")
def demo_coordinator(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("coordinator")
    started = []

    def spawn(name, *args, env=None):
        started.append(Process(list(args), tmp / f"{name}.log", env))
        return started[-1]

    try:
        yield start_coordinator(spawn, tmp, "--preset", "demo", "--run-id", "cli-test")[1]
    finally:
        for process in started:
            process.stop()


def test_unparseable_multiaddr(spawn):
    peer = spawn("peer", "peers/join.py", "--host", "127.0.0.1", "--initial-peers", "not-a-multiaddr")
    assert_clean_error(peer, peer.wait(timeout=60), r"'not-a-multiaddr' is not a multiaddress")


def test_nobody_listens(spawn):
    address = f"/ip4/127.0.0.1/tcp/{_free_port()}/p2p/{SOME_PEER_ID}"
    started = time.monotonic()
    peer = spawn("peer", "peers/join.py", "--host", "127.0.0.1", "--initial-peers", address)
    assert_clean_error(peer, peer.wait(timeout=90), r"could not reach any initial peer .*coordinator running")
    assert time.monotonic() - started < 60


def test_fingerprint_mismatch_reached_through_environment(spawn, demo_coordinator):
    # No --initial-peers: the address comes from HIVETRAIN_INITIAL_PEERS, and the peer really reaches the swarm.
    peer = spawn("peer", "peers/join.py", "--host", "127.0.0.1", "--preset", "cifar10-vit-b32",
                 env={INITIAL_PEERS_ENV: " ".join(demo_coordinator)})
    assert_clean_error(peer, peer.wait(timeout=90), r"preset 'demo'.* differs from --preset cifar10-vit-b32")


def test_no_initial_peers_at_all(spawn):
    peer = spawn("peer", "peers/join.py", "--host", "127.0.0.1", env={INITIAL_PEERS_ENV: ""})
    assert_clean_error(peer, peer.wait(timeout=60), r"no initial peers")


def test_strategy_dht_uses_environment(monkeypatch, demo_coordinator):
    from hivetrain.strategy import HivemindStrategy
    from hivetrain.swarm_options import HivemindOptions

    monkeypatch.setenv(INITIAL_PEERS_ENV, ",".join(demo_coordinator))
    strategy = HivemindStrategy(HivemindOptions(run_id="cli-test", target_batch_size=64, batch_size=32),
                                network=DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    try:
        config = fetch_run(strategy.dht, initial_peers=demo_coordinator, timeout=30).config
        assert config.run_id == "cli-test"
        assert config.fingerprint == get_preset("demo").replace(run_id="cli-test").fingerprint
    finally:
        strategy.dht.shutdown()  # no Trainer ran, so there is no optimizer to shut down first


def test_pretrained_offline_without_file(spawn, tmp_path):
    _, addresses = start_coordinator(spawn, tmp_path, "--preset", "cifar10-vit-b32", "--run-id", "cli-pretrained",
                                     "--validate-every", "0")  # no CIFAR-10 here to validate on
    peer = spawn("peer", "peers/join.py", "--host", "127.0.0.1", "--initial-peers", *addresses)
    assert_clean_error(peer, peer.wait(timeout=90), r"cannot be downloaded .*--pretrained-weights FILE")


def test_coordinator_keeps_identity_and_port(spawn, tmp_path):
    port = _free_port()
    first, addresses = start_coordinator(spawn, tmp_path, "--preset", "demo", "--port", str(port), name="first")
    first.stop()
    assert first.popen.returncode == 0
    assert any("Coordinator stopped." in line for line in first.lines)
    _, again = start_coordinator(spawn, tmp_path, "--preset", "demo", "--port", str(port), name="first")
    assert again == addresses and f"/tcp/{port}/p2p/" in addresses[0]


def test_second_coordinator_on_a_busy_port(spawn, tmp_path):
    port = _free_port()
    start_coordinator(spawn, tmp_path, "--preset", "demo", "--port", str(port), name="first")
    second = spawn("second", "coordinator/start.py", "--preset", "demo", "--host", "127.0.0.1", "--port", str(port),
                   "--identity", str(tmp_path / "second.key"), "--log-dir", str(tmp_path / "second"))
    assert_clean_error(second, second.wait(timeout=60), r"cannot listen on .*another coordinator")


def test_swarm_settings_change_the_published_run_config():
    from hivetrain.roles.coordinator.options import parse_args, run_config

    preset = get_preset("demo")
    config = run_config(parse_args(["--preset", "demo", "--target-batch-size", "256", "--grad-compression", "fp16",
                                    "--average-state-every", "5"]))
    assert config.swarm.target_batch_size == 256 and config.swarm.grad_compression == "fp16"
    assert config.swarm.average_state_every == 5 and preset.swarm.average_state_every == 1
    assert config.swarm.state_compression == preset.swarm.state_compression and config.model == preset.model
    assert config.fingerprint != preset.fingerprint  # a peer holding the plain preset refuses this run
    assert run_config(parse_args(["--preset", "demo"])) == preset
    scheduled = run_config(parse_args(["--preset", "demo", "--warmup-steps", "10", "--total-steps", "120"]))
    assert (scheduled.optim.warmup_steps, scheduled.optim.total_steps) == (10, 120)
    assert scheduled.optim.lr == preset.optim.lr and scheduled.swarm == preset.swarm
    assert scheduled.fingerprint != preset.fingerprint
    robust = run_config(parse_args(["--preset", "demo", "--robust-aggregation", "centered-clip", "--clip-radius", "2"]))
    assert (robust.swarm.robust_aggregation, robust.swarm.clip_radius) == ("centered-clip", 2.0)
    assert robust.swarm.trim_fraction == preset.swarm.trim_fraction and robust.fingerprint != preset.fingerprint
    with pytest.raises(SystemExit):
        parse_args(["--preset", "demo", "--robust-aggregation", "median"])
    with pytest.raises(SystemExit):
        parse_args(["--preset", "demo", "--trim-fraction", "0.5"])
    grouped = run_config(parse_args(["--preset", "demo", "--mode", "diloco", "--target-group-size", "4"]))
    assert grouped.swarm.target_group_size == 4 and preset.swarm.target_group_size is None
    assert RunConfig.from_json(grouped.to_json()) == grouped  # what the coordinator publishes carries G
    ungrouped = grouped.replace(swarm=dataclasses.replace(grouped.swarm, target_group_size=None))
    assert grouped.fingerprint != ungrouped.fingerprint  # peers of a grouped and an ungrouped run never mix
    # a run without groups keeps the fingerprint it had before the setting existed (its checkpoints still resume)
    assert "target_group_size" not in ungrouped.to_json()
    paced = run_config(parse_args(["--preset", "demo", "--mode", "diloco", "--round-seconds", "30"]))
    assert paced.swarm.round_seconds == 30.0 and paced.fingerprint != preset.fingerprint
    assert RunConfig.from_json(paced.to_json()) == paced and "round_seconds" not in preset.to_json()
    with pytest.raises(SystemExit):
        parse_args(["--preset", "demo", "--round-seconds", "0.1"])


def test_target_batch_below_the_step_batch_is_refused(spawn, tmp_path):
    coordinator = spawn("coordinator", "coordinator/start.py", "--preset", "demo", "--host", "127.0.0.1", "--port",
                        "0", "--log-dir", str(tmp_path / "run"), "--target-batch-size", "8")
    assert_clean_error(coordinator, coordinator.wait(timeout=60),
                       r"--target-batch-size 8 is below the run.s per-step batch \(32\)")


@pytest.mark.parametrize("mode", ["sync", "diloco"])
def test_ctrl_c_leaves_the_swarm(spawn, tmp_path, mode):
    """Ctrl-C (SIGINT) stops a training peer cleanly in either mode: hivemind's averagers set SIGINT to "ignore" in the
    process that starts them, and the peer puts its handler back."""
    _, addresses = start_coordinator(spawn, tmp_path, "--preset", "demo", "--mode", mode, "--validate-every", "0")
    # Started as from a terminal: a test run launched in the background (`make test &`, nohup) ignores SIGINT, and
    # its children would inherit that; a handler in this process becomes the default one in the child.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        peer = spawn("peer", "peers/join.py", "--host", "127.0.0.1", "--initial-peers", *addresses, "--threads", "1",
                     "--events", str(tmp_path / "events.jsonl"))
    finally:
        signal.signal(signal.SIGINT, before)
    peer.wait_for(r"^First local step done", timeout=120)
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    # On a CPU without --batch-size the peer trains at the run's batch, with no search.
    assert "Batch: 32 per step (the run's)" in peer.lines, peer.lines[:10]
    chosen = [e for e in events if e["event"] == "batch_chosen"]
    assert [(e["batch_size"], e["micro_batch"], e["accumulate"], e["trials"]) for e in chosen] == [(32, 32, 1, None)]
    # a CPU peer uses none of the GPU's inner-loop speedups, and says so in its join line and training_started event
    assert any(line.startswith("Joined run") and "speedups: none, reachable" in line for line in peer.lines)
    (started,) = [event for event in events if event["event"] == "training_started"]
    assert started["speedups"] == dict(tf32=False, fused_adamw=False, pinned_memory=False, compile=False)
    reader = record_reader(addresses)
    try:
        progress = f"{get_preset('demo').run_id}_progress"
        _wait_until(lambda: [value is not None for value, _ in dht_entries(reader, progress)] == [True], "the peer's progress record")
        # A terminal's Ctrl-C reaches the whole process group: the peer and the DHT, averager and p2pd processes it
        # started. They outlive the peer's goodbye, which withdraws its progress record before it exits.
        os.killpg(peer.popen.pid, signal.SIGINT)
        assert peer.wait(timeout=60) == 0
        assert any(line == "Left the swarm." for line in peer.lines), peer.lines[-20:]
        assert [value is not None for value, _ in dht_entries(reader, progress)] == [False]
    finally:
        reader.shutdown()


def _wait_until(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.5)


def test_join_batch_size_takes_auto_or_a_number(capsys):
    from hivetrain.roles.peers.join import parse_args

    assert parse_args([]).batch_size is None  # the default: auto on a GPU, the run's batch on a CPU
    assert parse_args(["--batch-size", "auto"]).batch_size == "auto"
    assert parse_args(["--batch-size", "48"]).batch_size == 48
    assert parse_args(["--batch-size", "auto", "--memory-budget", "12GiB"]).memory_budget == 12 * 2**30
    for bad in (["--batch-size", "0"], ["--batch-size", "lots"], ["--memory-budget", "plenty"]):
        with pytest.raises(SystemExit) as exited:
            parse_args(bad)
        assert exited.value.code == 2
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert error.startswith("python peers/join.py: error: argument --batch-size") or "--memory-budget" in error
