import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import boto3
import pytest
from s3server import SeaweedS3

ROOT = Path(__file__).resolve().parent.parent
BUCKET = "hivetrain-test"  # S3 bucket names need 3 to 63 characters
# Tests never reach the Hugging Face hub; every process they start inherits this.
os.environ["HF_HUB_OFFLINE"] = "1"


class Process:
    """A role started as its own process, its combined output collected line by line."""

    def __init__(self, args: list[str], log: Path, env: dict | None = None, prefix: list[str] = ()):
        self.log = log
        self.lines: list[str] = []
        self.times: list[float] = []  # when each line arrived (time.time())
        self.popen = subprocess.Popen(
            [*prefix, sys.executable, *args],  # prefix: e.g. `ip netns exec NAME`
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            bufsize=1, env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
            start_new_session=True,  # its own process group: kill() takes its hivemind processes and p2pd with it
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with self.log.open("w") as out:
            for line in self.popen.stdout:
                out.write(line)
                self.times.append(time.time())
                self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if match := re.search(pattern, line):
                    return match
            if self.popen.poll() is not None:
                self._reader.join(5)
                for line in self.lines:
                    if match := re.search(pattern, line):
                        return match
                raise AssertionError(f"process exited ({self.popen.returncode}) before {pattern!r}; log {self.log}")
            time.sleep(0.1)
        raise AssertionError(f"no {pattern!r} within {timeout} s; log {self.log}")

    def wait(self, timeout: float) -> int:
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"still running after {timeout} s; log {self.log}")
        self._reader.join(10)
        return code

    def kill(self) -> None:
        """Vanish without a goodbye, as a machine that loses power: SIGKILL to every process it started."""
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait()

    def stop(self) -> None:
        """SIGTERM, as a user's Ctrl-C; whatever is left of its process group after 30 s is killed."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


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


def assert_clean_error(process: Process, code: int, message: str) -> None:
    """Bad input: exit code 2, one line starting with "error:" that matches `message`, no traceback."""
    assert code == 2, process.lines
    assert not any("Traceback" in line for line in process.lines), process.lines
    errors = [line for line in process.lines if line.startswith("error:")]
    assert len(errors) == 1 and re.search(message, errors[0]), process.lines


@pytest.fixture
def spawn(tmp_path):
    started: list[Process] = []

    def start(name: str, *args: str, env: dict | None = None, prefix: list[str] = ()) -> Process:
        process = Process(list(args), tmp_path / f"{name}.log", env, prefix)
        started.append(process)
        return process

    yield start
    for process in reversed(started):
        process.stop()


def start_coordinator(spawn, tmp_path: Path, *extra: str, name: str = "coordinator") -> tuple[Process, list[str]]:
    coordinator = spawn(name, "coordinator/start.py", "--host", "127.0.0.1", "--port", "0",
                        "--identity", str(tmp_path / f"{name}.key"), "--log-dir", str(tmp_path / name),
                        "--refresh", "2", *extra)
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
