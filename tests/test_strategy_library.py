"""HivemindStrategy as a library piece: anyone's LightningModule, as the README shows it."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README_SECTION = "## Your own LightningModule in a swarm"


def _readme_example() -> str:
    """The first Python block of the README's section on bringing your own LightningModule."""
    readme = (ROOT / "README.md").read_text()
    assert README_SECTION in readme, f"README.md has no section {README_SECTION!r}"
    section = readme.split(README_SECTION, 1)[1]
    match = re.search(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert match is not None, f"no Python block under {README_SECTION!r}"
    return match.group(1)


def test_readme_example_trains_in_a_swarm(tmp_path):
    """The README's example runs as written, in a fresh process, and takes every step it asks for."""
    script = tmp_path / "example.py"
    script.write_text(_readme_example() + "\nprint(f'trained {trainer.global_step} steps')\n")
    env = {key: value for key, value in os.environ.items() if key != "HIVETRAIN_INITIAL_PEERS"}  # a swarm of its own
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "trained 40 steps" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]


def test_package_exports_the_strategy_without_importing_it_for_config():
    """`from hivetrain import HivemindStrategy` works, and `import hivetrain.config` (what the roles import first, to
    parse their arguments) still loads neither hivemind nor Lightning."""
    probe = (
        "import sys, hivetrain.config\n"
        "heavy = sorted(m for m in ('hivemind', 'lightning', 'torch') if m in sys.modules)\n"
        "from hivetrain import DHTOptions, HivemindOptions, HivemindStrategy\n"
        "from hivetrain.strategy import HivemindStrategy as Defined\n"
        "print(heavy, HivemindStrategy is Defined, DHTOptions.__module__, HivemindOptions.__module__)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["[]", "True", "hivetrain.swarm", "hivetrain.strategy"]

