"""A network namespace joined to this host by a veth pair, for tests that cut a peer off the network or put it behind
NAT. Needs root (CI runs as root); `VethNamespace.unavailable()` says why it cannot be made here."""

from __future__ import annotations

import os
import subprocess
from typing import Optional


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class VethNamespace:
    """Namespace `name` whose only link is a veth to the host: the host side has 10.77.<subnet>.1, the namespace side
    10.77.<subnet>.2. cut() takes the namespace's side down (the host keeps its address), restore() brings it back."""

    def __init__(self, subnet: int):
        self.name = f"hivetrain-{os.getpid()}-{subnet}"
        self.host_ip, self.ns_ip = f"10.77.{subnet}.1", f"10.77.{subnet}.2"
        self._host_link, self._ns_link = f"htv{os.getpid() % 10000}h{subnet}", f"htv{os.getpid() % 10000}n{subnet}"

    @staticmethod
    def unavailable() -> Optional[str]:
        probe = VethNamespace(254)
        try:
            probe.create()
        except (OSError, subprocess.CalledProcessError) as e:
            detail = e.stderr.strip() if isinstance(e, subprocess.CalledProcessError) else str(e)
            return f"cannot create a network namespace here ({detail or e}); needs root and iproute2"
        finally:
            probe.delete()
        return None

    def create(self) -> "VethNamespace":
        _ip("netns", "add", self.name)
        _ip("link", "add", self._host_link, "type", "veth", "peer", "name", self._ns_link)
        _ip("link", "set", self._ns_link, "netns", self.name)
        _ip("addr", "add", f"{self.host_ip}/24", "dev", self._host_link)
        _ip("link", "set", self._host_link, "up")
        _ip("-n", self.name, "addr", "add", f"{self.ns_ip}/24", "dev", self._ns_link)
        _ip("-n", self.name, "link", "set", self._ns_link, "up")
        _ip("-n", self.name, "link", "set", "lo", "up")
        return self

    @property
    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def cut(self) -> None:
        _ip("-n", self.name, "link", "set", self._ns_link, "down")

    def restore(self) -> None:
        _ip("-n", self.name, "link", "set", self._ns_link, "up")

    def delete(self) -> None:
        """Kill whatever still runs inside, then remove the namespace (its veth end, and so the pair, goes with it)."""
        pids = _ip("netns", "pids", self.name, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), 9)
            except (ProcessLookupError, ValueError):
                pass
        _ip("netns", "del", self.name, check=False)
        _ip("link", "del", self._host_link, check=False)
