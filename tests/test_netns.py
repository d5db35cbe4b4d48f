"""The network namespaces tests build (benchmarks.netns): a run killed before its cleanup leaves its namespace behind,
and the next run of the same subnet must still work."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.netns import VethNamespace, remove_orphans

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.netns  # it lists and builds the host's namespaces (conftest.py)


def _namespaces() -> list[str]:
    return [line.split(" ", 1)[0] for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                                             check=True).stdout.splitlines()]


def test_a_namespace_left_by_a_killed_run_is_removed_before_the_next_is_built():
    if reason := VethNamespace.unavailable():
        pytest.skip(reason)
    # A process builds subnet 3's namespace and exits without deleting it, as a run killed mid-test does.
    left = subprocess.run([sys.executable, "-c", "from benchmarks.netns import VethNamespace;"
                           " print(VethNamespace(3).create().name)"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert left in _namespaces()
    network = VethNamespace(3).create()
    try:
        assert left not in _namespaces() and network.name in _namespaces()
        # the new namespace reaches the host's side of its own link (the orphan's 10.77.3.1 took that route before)
        with socket.create_server((network.host_ip, 0)) as server:
            port = server.getsockname()[1]
            dial = subprocess.run([*network.exec_prefix, sys.executable, "-c",
                                   f"import socket; socket.create_connection(('{network.host_ip}', {port}), 5)"],
                                  capture_output=True, text=True, timeout=30)
        assert dial.returncode == 0, dial.stderr
        assert remove_orphans() == []  # a namespace whose process lives is kept
    finally:
        network.delete()
