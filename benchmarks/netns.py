"""Network namespaces for tests and benchmarks: one joined to this host by a veth pair (a peer cut off the network),
one behind NAT, and two joined to each other by a rate-limited veth pair (peers on a volunteer's link). Needs root
(CI runs as root); each class's `unavailable()` says why it cannot be made here."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Optional

IPTABLES = shutil.which("iptables") or "/usr/sbin/iptables"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _cannot_build(network, what: str) -> Optional[str]:
    """Why `network` cannot be created here (it is built and removed again), or None when it can."""
    try:
        network.create()
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr.strip() if isinstance(e, subprocess.CalledProcessError) else str(e)
        return f"cannot {what} here ({detail or e}); needs root and iproute2"
    finally:
        network.delete()
    return None


def _kill_inside(namespace: str) -> None:
    for pid in _ip("netns", "pids", namespace, check=False).stdout.split():
        try:
            os.kill(int(pid), 9)
        except (ProcessLookupError, ValueError):
            pass


def remove_orphans() -> list[str]:
    """Remove the namespaces that a process now gone left behind (`hivetrain-<pid>-...`: a test run killed before its
    cleanup), with what still runs inside; their veth pairs go with them. A left-over host address (10.77.1.1) took
    the route of the next run's namespace of the same subnet, and its peer could reach nothing ("could not reach any
    initial peer"). Returns the names removed."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split(" ", 1)[0]
        owner = re.fullmatch(r"hivetrain-(\d+)-.*", name)
        if owner is None or _alive(int(owner.group(1))):
            continue
        _kill_inside(name)
        _ip("netns", "del", name, check=False)
        removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


class VethNamespace:
    """Namespace `name` whose only link is a veth to the host: the host side has 10.77.<subnet>.1, the namespace side
    10.77.<subnet>.2. cut() takes the namespace's side down (the host keeps its address), restore() brings it back."""

    def __init__(self, subnet: int):
        self.name = f"hivetrain-{os.getpid()}-{subnet}"
        self.host_ip, self.ns_ip = f"10.77.{subnet}.1", f"10.77.{subnet}.2"
        self._host_link, self._ns_link = f"htv{os.getpid() % 10000}h{subnet}", f"htv{os.getpid() % 10000}n{subnet}"

    @staticmethod
    def unavailable() -> Optional[str]:
        return _cannot_build(VethNamespace(254), "create a network namespace")

    def create(self) -> "VethNamespace":
        remove_orphans()
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
        _kill_inside(self.name)
        _ip("netns", "del", self.name, check=False)
        _ip("link", "del", self._host_link, check=False)


class NattedNamespace:
    """A peer behind NAT: namespace `<name>-peer` (192.168.<subnet>.2) routes through namespace `<name>-nat`, which
    masquerades it as 10.78.<subnet>.2 towards this host (10.78.<subnet>.1). The host has no route back to the peer's
    network, as with a home router: the peer dials out, nobody dials in."""

    def __init__(self, subnet: int):
        tag = f"{os.getpid() % 10000}n{subnet}"
        self.router, self.peer = f"hivetrain-{os.getpid()}-{subnet}-nat", f"hivetrain-{os.getpid()}-{subnet}-peer"
        self.host_ip, self.outside_ip = f"10.78.{subnet}.1", f"10.78.{subnet}.2"
        self.inside_ip, self.peer_ip = f"192.168.{subnet}.1", f"192.168.{subnet}.2"
        self._links = (f"htr{tag}h", f"htr{tag}o", f"htr{tag}i", f"htr{tag}p")

    @staticmethod
    def unavailable() -> Optional[str]:
        if not os.path.exists(IPTABLES):
            return "iptables is not installed (scripts/install-system-test-deps.sh installs it as root)"
        return _cannot_build(NattedNamespace(254), "build a NAT between network namespaces")

    def create(self) -> "NattedNamespace":
        remove_orphans()
        host, outside, inside, peer = self._links
        _ip("netns", "add", self.router)
        _ip("netns", "add", self.peer)
        _ip("link", "add", host, "type", "veth", "peer", "name", outside)
        _ip("link", "set", outside, "netns", self.router)
        _ip("addr", "add", f"{self.host_ip}/24", "dev", host)
        _ip("link", "set", host, "up")
        _ip("-n", self.router, "addr", "add", f"{self.outside_ip}/24", "dev", outside)
        _ip("-n", self.router, "link", "set", outside, "up")
        # as a home router's default route to its provider: what the host reaches (another NAT's side too) it forwards
        _ip("-n", self.router, "route", "add", "default", "via", self.host_ip)
        _ip("-n", self.router, "link", "add", inside, "type", "veth", "peer", "name", peer)
        _ip("-n", self.router, "link", "set", peer, "netns", self.peer)
        _ip("-n", self.router, "addr", "add", f"{self.inside_ip}/24", "dev", inside)
        _ip("-n", self.router, "link", "set", inside, "up")
        _ip("-n", self.peer, "addr", "add", f"{self.peer_ip}/24", "dev", peer)
        _ip("-n", self.peer, "link", "set", peer, "up")
        _ip("-n", self.peer, "link", "set", "lo", "up")
        _ip("-n", self.peer, "route", "add", "default", "via", self.inside_ip)
        subprocess.run(["ip", "netns", "exec", self.router, "sysctl", "-qw", "net.ipv4.ip_forward=1"], check=True,
                       capture_output=True, text=True)
        subprocess.run(["ip", "netns", "exec", self.router, IPTABLES, "-t", "nat", "-A", "POSTROUTING", "-o",
                        outside, "-j", "MASQUERADE"], check=True, capture_output=True, text=True)
        return self

    @property
    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.peer]

    def delete(self) -> None:
        for namespace in (self.peer, self.router):
            _kill_inside(namespace)
            _ip("netns", "del", namespace, check=False)
        _ip("link", "del", self._links[0], check=False)


class LinkedNamespaces:
    """Two namespaces, `<name>-a` (10.79.<subnet>.1) and `<name>-b` (10.79.<subnet>.2), whose only link is one veth
    pair: all traffic between what runs in them crosses it. limit() shapes both directions with a token bucket (tbf,
    which this kernel has; netem does not exist here), as a volunteer's up- and downlink."""

    def __init__(self, subnet: int):
        tag = f"{os.getpid() % 10000}l{subnet}"
        self.a, self.b = f"hivetrain-{os.getpid()}-{subnet}-a", f"hivetrain-{os.getpid()}-{subnet}-b"
        self.a_ip, self.b_ip = f"10.79.{subnet}.1", f"10.79.{subnet}.2"
        self.a_link, self.b_link = f"htl{tag}a", f"htl{tag}b"

    @staticmethod
    def unavailable() -> Optional[str]:
        return _cannot_build(LinkedNamespaces(254), "link two network namespaces")

    def create(self) -> "LinkedNamespaces":
        remove_orphans()
        _ip("netns", "add", self.a)
        _ip("netns", "add", self.b)
        _ip("-n", self.a, "link", "add", self.a_link, "type", "veth", "peer", "name", self.b_link)
        _ip("-n", self.a, "link", "set", self.b_link, "netns", self.b)
        for namespace, link, address in ((self.a, self.a_link, self.a_ip), (self.b, self.b_link, self.b_ip)):
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", link)
            _ip("-n", namespace, "link", "set", link, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
        return self

    def exec_prefix(self, side: str) -> list[str]:
        return ["ip", "netns", "exec", self.a if side == "a" else self.b]

    def limit(self, mbit: float) -> None:
        """Both directions at `mbit` Mbit/s. The bucket holds 10 ms of traffic (at least 32 kbit), so the rate holds
        over any stretch longer than that; packets wait up to 400 ms in the queue before being dropped."""
        burst = max(4096, int(mbit * 1e6 / 8 / 100))
        for namespace, link in ((self.a, self.a_link), (self.b, self.b_link)):
            subprocess.run(["tc", "-n", namespace, "qdisc", "replace", "dev", link, "root", "tbf", "rate",
                            f"{mbit}mbit", "burst", str(burst), "latency", "400ms"], check=True, capture_output=True,
                           text=True)

    def sent_bytes(self) -> int:
        """Bytes sent over the link so far, both directions."""
        total = 0
        for namespace, link in ((self.a, self.a_link), (self.b, self.b_link)):
            total += int(subprocess.run(["ip", "netns", "exec", namespace, "cat",
                                         f"/sys/class/net/{link}/statistics/tx_bytes"], check=True,
                                        capture_output=True, text=True).stdout)
        return total

    def delete(self) -> None:
        for namespace in (self.a, self.b):
            _kill_inside(namespace)
            _ip("netns", "del", namespace, check=False)
