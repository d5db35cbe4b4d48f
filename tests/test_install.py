"""`pip install hivetrain` is the volunteer peer's install: the peer's imports stay clear of the extras'
packages, and the roles that need an extra name it when it is missing."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# What the coordinator, dashboard and benchmark extras bring. matplotlib and nvidia-ml-py (bench) are not listed:
# torchmetrics and torch import them whenever they are installed, as they are here, and run without them.
EXTRAS_PACKAGES = ("boto3", "botocore", "s3transfer", "tensorboard", "streamlit", "pandas", "altair")


def test_the_peer_imports_no_extra():
    """Everything peers/join.py imports on its way to training: its module, what main() imports and the training
    stack it imports in a thread."""
    probe = (
        "import sys, hivetrain.roles.peers.join\n"
        "import hivetrain.access, hivetrain.config, hivetrain.reachability, hivetrain.swarm, hivetrain.telemetry\n"
        "hivetrain.roles.peers.join._import_training_stack()\n"
        "assert 'hivetrain.strategy' in sys.modules and 'lightning' in sys.modules\n"
        f"print(sorted(m for m in {EXTRAS_PACKAGES!r} if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[-2] == "[]", result.stdout


@pytest.mark.parametrize("module, args, extra", [
    ("hivetrain.roles.coordinator.start", ["--preset", "demo"], "coordinator"),
    ("hivetrain.roles.dashboard.launch", ["--store", "runs/none.sqlite"], "dashboard"),
])
def test_a_role_without_its_extra_says_what_to_install(module, args, extra):
    """`python -S` leaves site-packages out: none of the extra's packages can be found, as in a peer-only install."""
    result = subprocess.run([sys.executable, "-S", "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip().endswith(f"not installed here: pip install -e '.[{extra}]' in a clone, or"
                                          f" 'hivetrain[{extra}] @ WHEEL_OR_GIT_ADDRESS'"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_the_coordinator_starts_without_lightning(spawn, tmp_path):
    """The coordinator validates and holds the swarm's state with plain torch (hivetrain.datasets, hivetrain.optimizer):
    Lightning and the torchmetrics it imports whole, seconds of CPU at every start, stay out of it. Python lists every
    module a process imports when PYTHONPROFILEIMPORTTIME is set."""
    coordinator = spawn("coordinator", "coordinator/start.py", "--preset", "demo", "--host", "127.0.0.1", "--port",
                        "0", "--identity", str(tmp_path / "coordinator.key"), "--log-dir", str(tmp_path / "run"),
                        "--validate-every", "1", env={"PYTHONPROFILEIMPORTTIME": "1"})
    coordinator.wait_for(r"peers/join.py --initial-peers", timeout=90)
    imported = {line.rpartition("|")[2].strip() for line in coordinator.lines if line.startswith("import time:")}
    assert {"torch", "timm", "hivemind", "hivetrain.datasets", "hivetrain.optimizer"} <= imported  # the whole list
    assert not {name for name in imported if name.split(".")[0] in ("lightning", "pytorch_lightning", "torchmetrics")}
