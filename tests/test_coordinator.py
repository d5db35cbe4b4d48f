"""The coordinator as a process: it resumes a run from a checkpoint and serves that state to joiners, and it refuses a
damaged or foreign checkpoint before touching the run; SIGUSR1 shows where each of its processes stands."""

import time

import torch

from conftest import assert_clean_error, start_coordinator
from hivetrain.roles.coordinator.start import status_line
from hivetrain.checkpoint import Checkpoint, LocalCheckpointStore
from hivetrain.config import get_preset
from hivetrain.data import make_datamodule
from hivetrain.evaluate import evaluate
from hivetrain.metrics_store import MetricsReader, SwarmSnapshot
from hivetrain.model import create_model
from hivetrain.optimizer import make_optimizer
from hivetrain.roles.peers.progress import parameter_digest

CONFIG = get_preset("demo").replace(run_id="resume-test")
EPOCH = 7


def _trained_checkpoint() -> Checkpoint:
    """A checkpoint whose weights and optimizer statistics differ from any fresh model's: a few real AdamW steps."""
    model = create_model(CONFIG.model, seed=CONFIG.seed)
    optimizer, scheduler = make_optimizer(model, CONFIG.optim)
    images, labels = next(iter(make_datamodule(CONFIG, batch_size=64).train_dataloader()))
    for _ in range(3):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        scheduler.step()
    return Checkpoint.from_model(model, CONFIG, EPOCH, dict(top1=0.5), optimizer, scheduler)


def test_resume_serves_the_checkpoint_to_joiners(spawn, tmp_path):
    checkpoint = _trained_checkpoint()
    uri = LocalCheckpointStore(tmp_path / "saved").save(checkpoint, best=True)
    coordinator, addresses = start_coordinator(spawn, tmp_path, "--preset", "demo", "--run-id", CONFIG.run_id,
                                               "--resume", str(tmp_path / "saved"))
    coordinator.wait_for(rf"Resuming from .*swarm epoch {EPOCH}", timeout=1)
    # The coordinator validates what it resumed before anyone joins.
    coordinator.wait_for(rf"validation at swarm epoch {EPOCH}: top-1", timeout=60)
    peer = spawn("peer", "peers/join.py", "--host", "127.0.0.1", "--initial-peers", *addresses, "--threads", "1",
                 "--stop-at-epoch", str(EPOCH + 1))
    start = peer.wait_for(r"Starting at swarm epoch (\d+) \| params (\w+)", timeout=120)
    model = checkpoint.build_model()
    assert (int(start.group(1)), start.group(2)) == (EPOCH, parameter_digest(model))
    assert peer.wait(timeout=120) == 0
    with MetricsReader(tmp_path / "coordinator" / "metrics.sqlite") as reader:
        validation = next(v for v in reader.validations() if v.epoch == EPOCH)
    expected = evaluate(model, make_datamodule(CONFIG).val_dataloader())
    assert (validation.top1, validation.loss) == (expected["top1"], expected["loss"])
    assert uri.endswith(f"ckpt-{EPOCH:06d}.tar")


def test_sigusr1_prints_every_threads_stack_of_each_process_and_the_role_goes_on(spawn, tmp_path):
    """What a hung role waits for (a test that gives up on one asks it so: benchmarks.harness.Process.dump_stacks):
    the coordinator and the processes it forked (its DHT's, its state holder's averager) each print their threads'
    stacks, and the coordinator goes on serving."""
    coordinator, _ = start_coordinator(spawn, tmp_path, "--preset", "demo")
    coordinator.dump_stacks()
    deadline = time.monotonic() + 10
    while sum(line.startswith("Current thread 0x") for line in coordinator.lines) < 2:
        assert time.monotonic() < deadline, coordinator.lines[-40:]
        time.sleep(0.2)
    assert any("in run_role" in line for line in coordinator.lines)  # the main process's main thread, inside its role
    dumped = len(coordinator.lines)
    deadline = time.monotonic() + 15
    while not any(line.startswith("swarm epoch ") for line in coordinator.lines[dumped:]):  # a status line per look
        assert coordinator.popen.poll() is None and time.monotonic() < deadline, coordinator.lines[dumped:]
        time.sleep(0.2)


def test_resume_refuses_a_damaged_or_foreign_checkpoint(spawn, tmp_path):
    path = LocalCheckpointStore(tmp_path / "saved").save(_trained_checkpoint())
    data = open(path, "rb").read()
    damaged = tmp_path / "damaged.tar"
    damaged.write_bytes(data[: len(data) // 2])
    for name, args, message in [
        ("damaged", ["--run-id", CONFIG.run_id, "--resume", str(damaged)], r"damaged\.tar"),
        ("foreign", ["--run-id", "another-run", "--resume", path], r"not of this run .*--run-id resume-test"),
    ]:
        log_dir = tmp_path / name
        coordinator = spawn(name, "coordinator/start.py", "--preset", "demo", "--host", "127.0.0.1", "--port", "0",
                            "--identity", str(tmp_path / "key"), "--log-dir", str(log_dir), *args)
        assert_clean_error(coordinator, coordinator.wait(timeout=60), message)
        assert not log_dir.exists()  # no store, no checkpoints folder: the run was not touched


def test_the_status_line_counts_the_peers_in_client_mode():
    def line(alive: int, clients: int) -> str:
        return status_line(SwarmSnapshot(0.0, 3, alive, clients, 100.0, 64, 128, None, None), 0.1)

    # with every peer in client mode the coordinator leads their rounds (hivetrain.roles.coordinator.relay)
    assert "| 2 peers (2 in client mode) |" in line(2, 2)
    assert "| 2 peers (1 in client mode) |" in line(2, 1)
    assert "| 1 peer (1 in client mode) |" in line(1, 1)
    assert "client mode" not in line(2, 0)


def test_the_status_line_gives_no_target_before_a_paced_round_has_one():
    """A round paced in seconds has as many samples as the swarm trains in that time: none known before the peers'
    records state a rate, and the line shows the samples alone rather than "64/0"."""
    def line(target: int) -> str:
        return status_line(SwarmSnapshot(0.0, 3, 2, 0, 0.0, 64, target, 1.5, None), 0.1)

    assert "| 64 samples toward the next epoch, next in ~2 s |" in line(0)
    assert "| 64/128 samples toward the next epoch" in line(128)
