"""A volunteer with no clone: the wheel installs the `hivetrain` package alone, and its `hivetrain-join` joins a run."""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from conftest import start_coordinator

ROOT = Path(__file__).resolve().parent.parent
# What the wheel is built from: the package and what pyproject.toml names (a copy, so that no build/ left in the
# checkout by an earlier build can slip old files into it).
SOURCES = ("pyproject.toml", "README.md", "hivetrain")
REPOSITORY_TOOLS = ("coordinator", "peers", "dashboard", "baselines", "benchmarks", "scripts")


def _build_wheel(tmp_path: Path) -> Path:
    source = tmp_path / "source"
    tracked = subprocess.run(["git", "ls-files", *SOURCES], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    for name in tracked:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp_path / "dist"), str(source)], check=True, capture_output=True, timeout=300,
                   env=_clean_env())
    (wheel,) = (tmp_path / "dist").glob("hivetrain-*.whl")
    return wheel


def _clean_env() -> dict:
    """This process's environment without a path that could lead to the clone (a volunteer's has none)."""
    return {name: value for name, value in os.environ.items() if name not in ("PYTHONPATH", "PYTHONHOME")}


def _fresh_venv(tmp_path: Path, wheel: Path) -> Path:
    """A venv with the wheel alone installed in it, which sees this test venv's packages (torch, hivemind, ...) behind
    its own: the wheel installed --no-deps keeps the test quick. The test venv's editable hivetrain is not seen (a
    .pth line adds a folder to the path, it does not run that folder's .pth files)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120,
                   env=_clean_env())
    python = venv / "bin" / "python"
    # Installed before the test venv is in sight: pip must not find the clone's editable hivetrain there and call
    # the wheel installed already.
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                    "--no-index", "--force-reinstall", str(wheel)], check=True, capture_output=True, timeout=300,
                   env=_clean_env())
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True, env=_clean_env()).stdout.strip())
    (site / "test-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def test_a_wheel_installs_hivetrain_alone_and_joins_a_run(spawn, tmp_path):
    venv = _fresh_venv(tmp_path, _build_wheel(tmp_path))
    volunteer = tmp_path / "volunteer"  # no clone anywhere on its path
    volunteer.mkdir()
    found = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import importlib.util, hivetrain.roles.peers.join as join; print(join.__file__);"
         f" print([name for name in {REPOSITORY_TOOLS!r} if importlib.util.find_spec(name)])"],
        cwd=volunteer, env=_clean_env(), capture_output=True, text=True, timeout=120)
    assert found.returncode == 0, found.stderr[-2000:]
    location, tools = found.stdout.splitlines()
    assert Path(location).is_relative_to(venv) and tools == "[]", found.stdout

    _, addresses = start_coordinator(spawn, tmp_path, "--preset", "demo", "--mode", "sync", "--validate-every", "0")
    joined = subprocess.run(
        [str(venv / "bin" / "hivetrain-join"), "--initial-peers", *addresses, "--host", "127.0.0.1", "--threads", "1",
         "--stop-at-epoch", "1", "--max-time", "240"],
        cwd=volunteer, env=dict(_clean_env(), PYTHONUNBUFFERED="1"), capture_output=True, text=True, timeout=300)
    assert joined.returncode == 0, joined.stdout[-3000:] + joined.stderr[-3000:]
    assert "First local step done" in joined.stdout and "Leaving at swarm epoch 1" in joined.stdout, joined.stdout
