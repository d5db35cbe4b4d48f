import functools
import os
import re
import tempfile
import time
from pathlib import Path

import boto3
import pytest
from packaging.version import Version
from hivemind.utils.crypto import RSAPrivateKey
from s3server import SeaweedS3

# Roles start here as in the demo and the benchmarks; the tests import ROOT from here.
from benchmarks.harness import ROOT, Process  # noqa: F401

# A diloco peer's line on each outer round: "N: averaged ...", "N: alone", "N could not be averaged ...", and on one
# it missed: "Missed outer round N: loading the swarm's state" (hivetrain.diloco)
ROUND_LINE = re.compile(r"(?:Outer|Missed outer) round (\d+):? (.+)$")

BUCKET = "hivetrain-test"  # S3 bucket names need 3 to 63 characters
# The reliability page the fault tests and the takeover attacks write: a temporary one, or the committed one where
# `make logbook` names it.
RELIABILITY_PAGE = Path(os.environ.get("HIVETRAIN_RELIABILITY_PAGE")
                        or Path(tempfile.mkdtemp(prefix="hivetrain-reliability-")) / "reliability.md")
# The tests that mount issue 27's attacks and each add a row to the page's takeover section (`make logbook` runs them)
TAKEOVER_TESTS = ("tests/test_takeover.py", "tests/test_vouched_state.py", "tests/test_hostile_records.py",
                  "tests/test_access.py", "tests/test_reachability.py", "tests/test_revocation.py")
TAKEOVER_FINDINGS = ("run-record hijack", "epoch inflation", "poisoned state", "a coordinator crash",
                     "private runs leak", "one key, unlimited peers", "dial-back flood", "model settings")
# Tests never reach the Hugging Face hub; every process they start inherits this.
os.environ["HF_HUB_OFFLINE"] = "1"
# `make test` runs the suite on two pytest-xdist workers (--dist loadgroup). A file's tests stay together on one
# worker, where its module-scoped swarm serves them all; the tests marked `netns` share one worker, since the
# namespaces' host-side subnets are fixed by index (benchmarks.netns) and two of them built at once would clash.
# test_bench's smokes each start their own swarms in a subprocess: they go to whichever worker is free.
SPREAD_FILES = {"test_bench.py"}


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("dist", "no") == "loadgroup" and Version(pytest.__version__) >= Version("9.2"):
        # pytest-xdist#1386: its workers' group names no longer reach the scheduler, which spreads the groups
        raise pytest.UsageError("pytest 9.2 loses pytest-xdist's test groups (pytest-xdist#1386), and two workers would"
                                " build the same network namespaces at once: pip install 'pytest<9.2' (pyproject.toml)")


@pytest.hookimpl(tryfirst=True)  # before xdist's worker names each grouped test "<test>@<group>"
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("netns") is not None:
            item.add_marker(pytest.mark.xdist_group("netns"))
        elif item.path.name not in SPREAD_FILES:
            item.add_marker(pytest.mark.xdist_group(item.path.name))


@functools.cache
def publisher_identity() -> str:
    """An identity file holding this process's record-signing key, for a DHT that publishes a run record in the test's
    process: a joiner believes a run record only when its signing key hashes to the publisher's peer ID
    (hivetrain.run_record). One at a time: DHTs started with it share that peer ID."""
    from hivetrain.hivemind_internals import write_identity

    path = Path(tempfile.mkdtemp(prefix="hivetrain-publisher-")) / "identity.key"
    write_identity(RSAPrivateKey.process_wide(), str(path))
    return str(path)


def record_reader(addresses: list[str]):
    """A client DHT node that reads the swarm's records. RSASignatureValidator: the records are signed, and a reader
    without it cannot decode them (hivemind then never answers the read)."""
    import hivemind
    from hivemind.dht.crypto import RSASignatureValidator

    return hivemind.DHT(initial_peers=addresses, client_mode=True, record_validators=[RSASignatureValidator()],
                        start=True)


def dht_entries(dht, key: str) -> list[tuple[object, float]]:
    """(value, expiration) of each subkey under `key`; a withdrawn record's value is None."""
    found = dht.get(key, latest=True, return_future=True).result(timeout=30)
    if found is None or not isinstance(found.value, dict):
        return []
    return [(entry.value, entry.expiration_time) for entry in found.value.values()]


def live_entries(dht, key: str) -> int:
    """Entries under `key` that are not withdrawn (a leaving peer overwrites its own with None)."""
    return sum(value is not None for value, _ in dht_entries(dht, key))


def same_parameters(probe: list[float], other: list[float]) -> bool:
    """Two samples of the parameters (hivetrain.digests.tensors_probe) equal to float rounding: peers in
    step agree to the last bits or so, not bit for bit (hivetrain.digests), while the epochs a peer trains
    alone move each parameter by a learning rate's worth or more."""
    return len(probe) == len(other) and all(abs(x - y) <= 1e-6 + 1e-4 * abs(x) for x, y in zip(probe, other))


def assert_clean_error(process: Process, code: int, message: str) -> None:
    """Bad input: exit code 2, one line starting with "error:" that matches `message`, no traceback."""
    assert code == 2, process.lines
    assert not any("Traceback" in line for line in process.lines), process.lines
    errors = [line for line in process.lines if line.startswith("error:")]
    assert len(errors) == 1 and re.search(message, errors[0]), process.lines


@pytest.fixture
def cleanup():
    """What a test started in its own process (DHTs, averagers), shut down in reverse order: an averager before its
    DHT."""
    started = []
    yield started
    for item in reversed(started):
        item.shutdown()


@pytest.fixture
def spawn(tmp_path):
    started: list[Process] = []

    def start(name: str, *args: str, env: dict | None = None, prefix: list[str] = (),
              events: Path | None = None) -> Process:
        process = Process(list(args), tmp_path / f"{name}.log", env, prefix, events=events)
        started.append(process)
        return process

    yield start
    for process in reversed(started):
        process.stop()


def start_coordinator(spawn, tmp_path: Path, *extra: str, name: str = "coordinator",
                      events: Path | None = None) -> tuple[Process, list[str]]:
    coordinator = spawn(name, "coordinator/start.py", "--host", "127.0.0.1", "--port", "0",
                        "--identity", str(tmp_path / f"{name}.key"), "--log-dir", str(tmp_path / name),
                        "--refresh", "2", *extra, **({"events": events} if events is not None else {}))
    addresses = coordinator.wait_for(r"peers/join.py --initial-peers (.+)$", timeout=90).group(1).split()
    return coordinator, addresses


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A real SeaweedFS S3 server on loopback for the whole session, with a bucket, and the AWS env to reach it."""
    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs"))
    env = pytest.MonkeyPatch()
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        env.delenv(name, raising=False)  # a developer's own AWS setup must not leak into the tests
    for name, value in server.client_env().items():
        env.setenv(name, value)
    server.start()
    try:
        client = boto3.client("s3", endpoint_url=server.endpoint_url)
        deadline = time.monotonic() + 30
        while True:  # /healthz answers a moment before the filer behind the gateway does
            try:
                client.create_bucket(Bucket=BUCKET)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        yield server
    finally:
        server.stop()
        env.undo()


class TakeoverRows:
    """The reliability page's takeover section: a row per attack of issue 27 that a test mounted, with what the
    honest roles did as that test measured it (each test fails when they do otherwise). The section is rewritten at
    each row, so that it holds the rows of this session so far; the rest of the page stays as it is."""

    def __init__(self, page: Path):
        self.page, self.rows = page, {}

    def add(self, finding: int, attack: str, measured: str) -> None:
        """Finding `finding` (issue 27's number, 1-8), mounted as `attack`: the honest roles did `measured`."""
        from benchmarks.bench import environment, write_section
        from benchmarks.report import measured_by

        self.rows[(finding, attack)] = measured
        env = dict(environment(), command="pytest " + " ".join(TAKEOVER_TESTS))
        rows = "".join(f"| {number}. {TAKEOVER_FINDINGS[number - 1]} | {attack} | {measured} |\n"
                       for (number, attack), measured in sorted(self.rows.items(), key=lambda row: row[0][0]))
        write_section("takeover", (
            "## takeover\n\n"
            f"{measured_by(env)} Issue 27's attacks, each mounted by its test against the real roles on loopback: a"
            " plain hivemind process that signs what it stores with a key of its own, as any volunteer can (or the"
            " project's attacker, `tests/test_hostile_records.py`), and what the honest roles then did, as the test"
            " measured it.\n\n"
            "| finding | attack | what the honest roles did |\n|---|---|---|\n" + rows), page=self.page)


@pytest.fixture(scope="session")
def takeover_rows() -> TakeoverRows:
    return TakeoverRows(RELIABILITY_PAGE)
