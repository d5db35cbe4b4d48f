"""HiveTrain: decentralized volunteer training on hivemind and PyTorch Lightning.

The Lightning strategy is the library piece: `from hivetrain import HivemindStrategy, HivemindOptions, DHTOptions`.
"""

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

# Imported on first use: `import hivetrain.config` (the first thing peers/join.py and scripts/demo.py do, to parse
# their arguments and print help) must not pay for hivemind and Lightning.
_LAZY_EXPORTS = {
    "HivemindStrategy": "hivetrain.strategy",
    "HivemindOptions": "hivetrain.swarm_options",
    "DHTOptions": "hivetrain.swarm",
}

__all__ = sorted(_LAZY_EXPORTS)

if TYPE_CHECKING:
    from hivetrain.strategy import HivemindStrategy
    from hivetrain.swarm_options import HivemindOptions
    from hivetrain.swarm import DHTOptions


def __getattr__(name: str) -> Any:
    if name not in _LAZY_EXPORTS:
        # also how `from hivetrain import run_result` finds that a submodule is meant and imports it
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def install_hint(extra: str) -> str:
    """How to install an extra: no index serves the name `hivetrain`, so the extra goes on a clone or on the wheel or
    Git address HiveTrain was installed from."""
    return f"pip install -e '.[{extra}]' in a clone, or 'hivetrain[{extra}] @ WHEEL_OR_GIT_ADDRESS'"


def require_extra(extra: str, *modules: str) -> None:
    """Stop with the command that fixes it when a role's optional packages are missing: HiveTrain's own install is what
    a volunteer peer needs; the coordinator, dashboard and benchmarks come as extras (install_hint)."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(f"error: this needs {', '.join(missing)}, not installed here: {install_hint(extra)}")
