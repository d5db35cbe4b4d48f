"""hivemind's private API is used in the hivetrain/hivemind_internals package only, and only on the hivemind versions
it was written for."""

import ast
import os
import subprocess
import sys
import time
from pathlib import Path

import hivemind
import pytest

from hivetrain import hivemind_internals
from hivetrain.hivemind_internals import SUPPORTED_HIVEMIND_VERSIONS, check_hivemind_version
from hivetrain.hivemind_internals.records import PROGRESS_STORE_EVERY, HookedProgressTracker, progress_subkey

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hivetrain", "coordinator", "peers", "baselines")
INTERNALS = Path(hivemind_internals.__file__).resolve().parent  # the package's folder


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


def test_importing_the_internals_on_another_hivemind_fails_with_that_message():
    """The check runs at import, before any of hivemind's names that another version may lack are imported."""
    code = "import hivemind; hivemind.__version__ = '1.2.0'; import hivetrain.swarm"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: HiveTrain relies on hivemind internals") and "hivemind 1.2.0 is" in last


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_names_used(tree: ast.AST) -> set[str]:
    """Private attributes read or written, private methods defined or assigned (overrides), and private names as
    strings (getattr). An attribute of a standard library module the source imports (threading._shutdown) is
    Python's, not hivemind's, whatever name hivemind gives its own."""
    stdlib_imported = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                       for alias in node.names if alias.name in sys.stdlib_module_names}
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if not (isinstance(node.value, ast.Name) and node.value.id in stdlib_imported):
                names.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name):  # e.g. an override assigned in a class body
            names.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            names.add(node.value)
    return {name for name in names if _private(name)}


def _private_names_defined(tree: ast.AST) -> set[str]:
    """Private functions, methods and classes a source defines, and the private names it assigns (self._x = ...,
    _X = ...)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Attribute) and isinstance(leaf.ctx, ast.Store):
                        names.add(leaf.attr)
                    elif isinstance(leaf, ast.Name) and isinstance(leaf.ctx, ast.Store):
                        names.add(leaf.id)
    return {name for name in names if _private(name)}


def _sources(*packages: Path) -> list[Path]:
    return sorted(path for package in packages for path in package.rglob("*.py"))


def test_no_module_but_hivemind_internals_touches_hivemind_privates():
    """A private name that hivemind's source defines and ours does not, used anywhere in our packages but the
    internals package, is a use of hivemind's private API (a name both define, say _lock, cannot be told apart)."""
    ours = [path for path in _sources(*(ROOT / package for package in PACKAGES))
            if INTERNALS not in path.resolve().parents]
    hivemind_privates = set().union(*(_private_names_defined(ast.parse(path.read_text()))
                                      for path in _sources(Path(hivemind.__file__).parent)))
    ours_defined = set().union(*(_private_names_defined(ast.parse(path.read_text())) for path in ours))
    used_by_internals = set().union(*(_private_names_used(ast.parse(path.read_text())) for path in _sources(INTERNALS)))
    # what the internals package was made for is found as hivemind's: an empty set would make the check pass for nothing
    assert {"_local_public_key", "_parse_swarm_progress_data", "_get_local_progress", "_make_progress_tracker",
            "_make_gradient_averager", "_update_scheduler", "_default_handler", "_safe_check_pinned",
            "_PUBLIC_KEY_RE", "_SIGNATURE_RE"} <= used_by_internals & hivemind_privates
    offenders = []
    for path in ours:
        used = _private_names_used(ast.parse(path.read_text())) & (hivemind_privates - ours_defined)
        offenders += [f"{path.relative_to(ROOT)}: {name}" for name in sorted(used)]
    assert offenders == [], "hivemind privates outside hivetrain/hivemind_internals/"


# hivemind's DHT internals: a node's protocol object (its storage, cache, routing table, pings, validator and
# authorizer) and the modules that define what it holds. Public names, but no API: they belong with the privates.
DHT_INTERNAL_MODULES = ("hivemind.dht.protocol", "hivemind.dht.storage", "hivemind.dht.routing")


def _dht_internals_used(tree: ast.AST) -> set[str]:
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "protocol" and isinstance(node.value, ast.Name) \
                and node.value.id == "node":
            used.add("node.protocol")
        elif isinstance(node, ast.ImportFrom) and node.module in DHT_INTERNAL_MODULES:
            used.add(node.module)
        elif isinstance(node, ast.Import):
            used |= {alias.name for alias in node.names if alias.name in DHT_INTERNAL_MODULES}
    return used


def test_no_module_but_hivemind_internals_reaches_into_a_dht_node():
    ours = [path for path in _sources(*(ROOT / package for package in PACKAGES), ROOT / "benchmarks")
            if INTERNALS not in path.resolve().parents]
    # the check finds what the internals package does: an empty set would make it pass for nothing
    assert {"node.protocol", *DHT_INTERNAL_MODULES} <= set().union(
        *(_dht_internals_used(ast.parse(path.read_text())) for path in _sources(INTERNALS)))
    offenders = [f"{path.relative_to(ROOT)}: {name}" for path in ours
                 for name in sorted(_dht_internals_used(ast.parse(path.read_text())))]
    assert offenders == [], "a DHT node's internals outside hivetrain/hivemind_internals/"


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


def test_a_peers_progress_record_is_stored_at_most_every_half_second_but_at_once_when_others_need_it():
    """hivemind stored a peer's progress record at each report, that is at each step (up to 35 a second per peer on the
    demo), each one signed and verified by every DHT node it reached. At once: a new epoch, its first samples, and the
    samples that reach the target."""
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    stores: list[tuple[float, int, int]] = []  # (time, epoch, samples) of each store of the record
    store = dht.store

    def counted(key, value, *args, **kwargs):
        if isinstance(value, dict) and "samples_accumulated" in value:
            stores.append((time.monotonic(), value["epoch"], value["samples_accumulated"]))
        return store(key, value, *args, **kwargs)

    dht.store = counted  # the tracker's reporter stores through its DHT object
    TARGET = 1000
    tracker = HookedProgressTracker(dht, "throttled", target_batch_size=TARGET, start=True)
    try:
        began = time.monotonic()
        for samples in range(1, 201):  # 200 steps in about a second
            tracker.report_local_progress(0, samples)
            time.sleep(0.005)
        reported = time.monotonic()
        time.sleep(PROGRESS_STORE_EVERY + 0.5)
        within = [entry for entry in stores if entry[0] <= reported + PROGRESS_STORE_EVERY + 0.2]
        assert 2 <= len(within) <= (reported - began) / PROGRESS_STORE_EVERY + 2, within
        assert within[-1][1:] == (0, 200)  # the last report held back is stored when due
        assert all(b[0] - a[0] >= PROGRESS_STORE_EVERY / 2 for a, b in zip(within, within[1:])), within  # not per step

        def stored_at_once(epoch: int, samples: int, reported_at: float) -> None:
            while stores[-1][1:] != (epoch, samples) and time.monotonic() < reported_at + 2:
                time.sleep(0.01)
            assert stores[-1][1:] == (epoch, samples), stores[-3:]
            assert stores[-1][0] - reported_at < PROGRESS_STORE_EVERY / 2, (reported_at, stores[-3:])

        tracker.report_local_progress(0, 300)  # stored at once: the last store was over PROGRESS_STORE_EVERY ago
        reported_at = time.monotonic()
        with tracker.pause_updates():
            tracker.update_epoch(1)  # within PROGRESS_STORE_EVERY of it, but a new epoch: stored at once too
        stored_at_once(1, 0, reported_at)
        time.sleep(0.05)  # its reporter stored that one and waits again
        reported_at = time.monotonic()
        tracker.report_local_progress(1, 10)  # the epoch's first samples: at once (hivemind's reporter needs them)
        stored_at_once(1, 10, reported_at)
        time.sleep(0.05)
        tracker.report_local_progress(1, 20)  # held...
        reported_at = time.monotonic()
        tracker.report_local_progress(1, TARGET)  # ...but with this one the swarm reached its target: at once
        stored_at_once(1, TARGET, reported_at)
        found = dht.get(tracker.training_progress_key, latest=True).value[progress_subkey(tracker)].value
        assert (found["epoch"], found["samples_accumulated"]) == (1, TARGET)
    finally:
        tracker.shutdown(timeout=10)
        dht.shutdown()


def test_averager_subclasses_answer_under_hiveminds_rpc_names():
    """Peers call a state holder's RPCs by hivemind's class names ("TrainingStateAverager.rpc_download_state"): the
    coordinator's counting state averager and every robust averager must answer under them."""
    from hivemind.averaging import DecentralizedAverager
    from hivemind.optim.state_averager import TrainingStateAverager

    from hivetrain.roles.coordinator.state import CountingStateAverager

    for subclass, base in ((CountingStateAverager, TrainingStateAverager),
                           (hivemind_internals.robust_averager_class(TrainingStateAverager), TrainingStateAverager),
                           (hivemind_internals.robust_averager_class(DecentralizedAverager), DecentralizedAverager)):
        assert issubclass(subclass, base) and subclass is not base
        assert (subclass._get_handle_name("run", "rpc_download_state")
                == base._get_handle_name("run", "rpc_download_state"))
