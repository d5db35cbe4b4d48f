"""hivemind's private API is used in hivetrain/hivemind_internals.py only, and only on the hivemind versions it was
written for."""

import ast
import os
from pathlib import Path

import hivemind
import pytest

from hivetrain import hivemind_internals
from hivetrain.hivemind_internals import SUPPORTED_HIVEMIND_VERSIONS, check_hivemind_version

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hivetrain", "coordinator", "peers", "dashboard", "baselines")
INTERNALS = Path(hivemind_internals.__file__).resolve()


def test_the_installed_hivemind_is_one_the_internals_were_written_for():
    assert hivemind.__version__ in SUPPORTED_HIVEMIND_VERSIONS
    check_hivemind_version(hivemind.__version__)


@pytest.mark.parametrize("installed", ["1.1.11", "1.2.0", "2.0.0.dev0"])
def test_another_hivemind_version_is_refused_saying_what_to_install(installed):
    with pytest.raises(ImportError) as refused:
        check_hivemind_version(installed)
    message = str(refused.value)
    assert f"hivemind {installed} is installed" in message
    assert "1.1.12" in message and "pip install hivemind==1.1.12" in message


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_names_used(tree: ast.AST) -> set[str]:
    """Private attributes read or written, private methods defined or assigned (overrides), and private names as
    strings (getattr)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name):  # e.g. an override assigned in a class body
            names.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            names.add(node.value)
    return {name for name in names if _private(name)}


def _hivemind_private_names() -> set[str]:
    """The private names hivemind_internals uses, less its own module-level helpers: hivemind's."""
    tree = ast.parse(INTERNALS.read_text())
    own = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    return _private_names_used(tree) - own


def test_no_module_but_hivemind_internals_touches_hivemind_privates():
    hivemind_privates = _hivemind_private_names()
    # what the module was made for; an empty set would make the check below pass for nothing
    assert {"_local_public_key", "_parse_swarm_progress_data", "_get_local_progress", "_make_progress_tracker",
            "_make_gradient_averager", "_update_scheduler", "_default_handler", "_safe_check_pinned", "_private_key",
            "_PUBLIC_KEY_RE", "_SIGNATURE_RE", "_client"} <= hivemind_privates
    offenders = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.resolve() == INTERNALS:
                continue
            used = _private_names_used(ast.parse(path.read_text())) & hivemind_privates
            offenders += [f"{path.relative_to(ROOT)}: {name}" for name in sorted(used)]
    assert offenders == [], "hivemind privates outside hivetrain/hivemind_internals.py"


def test_a_dht_survives_many_large_stores_at_once():
    """Stores over 16 KiB travel to the DHT process in two writes; its command pipe must stay blocking so that a read
    between them waits for the rest instead of failing and killing the DHT."""
    dht = hivemind.DHT(start=True)
    try:
        flags = Path(f"/proc/{dht.pid}/fdinfo/{dht._inner_pipe.fileno()}").read_text().split("\n")[1]
        assert not int(flags.split()[1], 8) & os.O_NONBLOCK
        value, expiration = b"x" * 60_000, hivemind.utils.get_dht_time() + 60
        stores = [dht.store(f"key{i}", value + bytes([i % 256]), expiration, return_future=True) for i in range(300)]
        assert all(store.result(timeout=60) for store in stores)
        assert dht.is_alive() and dht.get("key299", latest=True).value == value + bytes([299 % 256])
    finally:
        dht.shutdown()


def test_averager_subclasses_answer_under_hiveminds_rpc_names():
    """Peers call a state holder's RPCs by hivemind's class names ("TrainingStateAverager.rpc_download_state"): the
    coordinator's counting state averager and every robust averager must answer under them."""
    from hivemind.averaging import DecentralizedAverager
    from hivemind.optim.state_averager import TrainingStateAverager

    from coordinator.state import CountingStateAverager

    for subclass, base in ((CountingStateAverager, TrainingStateAverager),
                           (hivemind_internals.robust_averager_class(TrainingStateAverager), TrainingStateAverager),
                           (hivemind_internals.robust_averager_class(DecentralizedAverager), DecentralizedAverager)):
        assert issubclass(subclass, base) and subclass is not base
        assert (subclass._get_handle_name("run", "rpc_download_state")
                == base._get_handle_name("run", "rpc_download_state"))
