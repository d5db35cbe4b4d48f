"""The swarm's plumbing shared by the coordinator and the peers: starting a DHT node with clear errors, the addresses
others can dial, the join command, and reads of the signed records the roles publish."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import faulthandler
import ipaddress
import logging
import os
import shlex
import signal
import socket
import sys
import threading
import time
from concurrent.futures import InvalidStateError
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterator, NoReturn, Optional, TypeVar

import hivemind
from hivemind.p2p import P2PDaemonError, PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr
from pydantic.v1 import BaseModel

from hivetrain.hivemind_internals import hivemind_log_handler, is_averager_cut_short, progress_subkey
from hivetrain.hivemind_internals.dht import ping, routing_table_peers
from hivetrain.record_guard import usable_entries

logger = logging.getLogger(__name__)

INITIAL_PEERS_ENV = "HIVETRAIN_INITIAL_PEERS"
DHT_READ_TIMEOUT = 10.0  # seconds a read of the DHT may take
# Seconds a peer's records live in the DHT (its training progress, its offer to share state): one that dies without
# a word stops counting this long after its last refresh. hivemind refreshes them at half their lifetime (its defaults,
# 60 s and 30 s, kept a dead peer in the round target and among the state donors for up to a minute).
RECORD_LIFETIME = 10.0
LEAVE_TIMEOUT = 5.0  # seconds a leaving peer waits for the DHT to take its withdrawn records
# A withdrawal outlives its records' lifetime by this much, so that it also beats a live record that the peer's own
# tracker may store while it stops (the DHT keeps, per subkey, the value that expires last).
WITHDRAWAL_MARGIN = 2.0


def group_matchmaking(target_group_size: Optional[int]) -> dict[str, Any]:
    """hivemind averager arguments for averaging in groups of at most `target_group_size` peers (None: one group).

    hivemind's matchmaking: every peer looking for a group declares itself under the averager's group key with the
    time its search ends; each asks the peers that declared earlier ends, earliest first, to lead it, and a leader
    closes its group once it holds target_group_size peers. Which peers end up together depends on who asks whom
    first, so the groups differ from round to round and parameters spread across the swarm over rounds (Moshpit).

    No group bits: Moshpit's grid (initial_group_bits: d bits make 2^d keys, and hivemind shifts new bits in after
    each round so that groupmates move to different keys) needs about G x 2^d peers, or a peer alone in its key
    misses its round; a volunteer swarm's size is not known in advance. Without bits the key stays `<prefix>.0b` for
    good, the one matchmaking key per averager that hivetrain.record_guard guards."""
    return dict(target_group_size=target_group_size, initial_group_bits="")


Record = TypeVar("Record", bound=BaseModel)


class SwarmError(RuntimeError):
    """A problem with the swarm a user can act on; its message is meant to be shown as it is."""


def daemon_start_error(error: P2PDaemonError, initial_peers: list[str]) -> SwarmError:
    """What a P2P daemon that did not start means to a user: most often, no initial peer could be reached."""
    if "bootstrap" in str(error):
        return SwarmError(
            f"could not reach any initial peer ({' '.join(initial_peers)}): is the coordinator running, is its port"
            " open to this machine, and is the address one this machine can dial (127.0.0.1 only works on the"
            " coordinator's own machine)?")
    return SwarmError(f"could not start the P2P daemon: {error}")


@dataclass
class DHTOptions:
    initial_peers: list[str] = field(default_factory=list)  # empty: read HIVETRAIN_INITIAL_PEERS, else start a swarm
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])  # where to listen
    announce_maddrs: list[str] = field(default_factory=list)  # the addresses others should dial (NAT, port forward)
    identity_path: Optional[str] = None  # private key file: the same peer ID across restarts
    client_mode: bool = False  # dial out only: for peers that nobody can reach
    use_relay: bool = True  # may reach peers behind NAT through libp2p circuit relays
    use_auto_relay: bool = False  # look for relays to become reachable while behind NAT
    startup_timeout: float = 30.0  # p2pd start; slow machines need more than hivemind's 15 s
    authorizer: Optional[Any] = None  # hivetrain.access.RunAuthorizer in a private run: DHT traffic needs a token


def listen_maddr(host: str, port: int) -> str:
    """The multiaddress to listen on for a --host/--port pair (IPv6 when the host has a colon)."""
    return f"/{'ip6' if ':' in host else 'ip4'}/{host}/tcp/{port}"


def parse_multiaddrs(values: list[str], what: str) -> list[str]:
    parsed = []
    for value in values:
        try:
            parsed.append(str(Multiaddr(value.strip())))
        except Exception as e:  # multiaddr raises several unrelated exception types
            raise SwarmError(f"{what}: {value!r} is not a multiaddress like /ip4/1.2.3.4/tcp/31337/p2p/Qm... ({e})")
    return parsed


def resolve_initial_peers(explicit: list[str]) -> list[str]:
    values = explicit or os.environ.get(INITIAL_PEERS_ENV, "").replace(",", " ").split()
    return parse_multiaddrs(values, "initial peer")


def check_port_free(host_maddrs: list[str]) -> None:
    """libp2p happily starts a second node on a busy port; refuse it instead of splitting the swarm."""
    for maddr in host_maddrs:
        protocols = dict((p.name, v) for p, v in Multiaddr(maddr).items())
        port = int(protocols.get("tcp", 0))
        host = protocols.get("ip4") or protocols.get("ip6")
        if not port or host is None:
            continue
        family = socket.AF_INET6 if "ip6" in protocols else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            # As the P2P daemon binds (Go sets SO_REUSEADDR): a restart may reuse a port whose old connections linger
            # in TIME_WAIT, while a live listener still refuses the bind.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as e:
                raise SwarmError(f"cannot listen on {maddr}: {e.strerror} (is another coordinator running?)") from None


class _HarmlessRaceFilter(logging.Filter):
    """Drops hivemind's tracebacks of harmless races: an averager process that has just exited leaves a message in
    the DHT's pipe whose reply channel is gone; a round this peer cancelled (its group given up, or no longer needed)
    ends in hivemind's averager all the same, which then fails to set the cancelled step's result (asyncio's "Task
    exception was never retrieved"). Every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and issubclass(record.exc_info[0], (FileNotFoundError, ConnectionError, EOFError)):
            return False
        if record.exc_info and issubclass(record.exc_info[0], InvalidStateError) and "CANCELLED" in str(
                record.exc_info[1]):
            return False
        return "Task was destroyed but it is pending" not in record.getMessage()


class _OneLinePerEvent(logging.Filter):
    """A volunteer's console shows one line per swarm event. hivemind logs ordinary events of a swarm (a round that
    found no group, a peer that left mid-round, a refused download) with their tracebacks, as if they were crashes:
    those lose the traceback and keep their message. The announcement before each state download goes too: the line
    after it says where from and how long it took."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith("Downloading parameters from peer"):
            return False
        if record.exc_info:
            error = record.exc_info[1]
            detail = f"{type(error).__name__}: {error}" if error is not None else ""
            if detail and str(error) not in record.getMessage():
                record.msg, record.args = f"{record.getMessage()} ({detail})", None
            record.exc_info = record.exc_text = None
        return True


def one_line_per_event() -> None:
    """Install _OneLinePerEvent on hivemind's log handler (a role's default; --verbose keeps hivemind's detail). Call
    it before starting the DHT: its processes are forked and inherit the filter."""
    handler = hivemind_log_handler()
    if handler is not None and not any(isinstance(f, _OneLinePerEvent) for f in handler.filters):
        handler.addFilter(_OneLinePerEvent())


def _quiet_unraisable(unraisable) -> None:
    # MPFuture.__del__ may run after its event loop closed during interpreter exit; nothing is lost then.
    if isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(unraisable.exc_value):
        return
    # Our SIGTERM's KeyboardInterrupt, landed where Python can only report it (a fork hook, a finalizer): the main
    # loops see the request through raise_if_leaving().
    if isinstance(unraisable.exc_value, KeyboardInterrupt) and _leaving.is_set():
        return
    # An averager whose __init__ that interrupt cut short cannot finalise itself; its process is a daemon and ends.
    if is_averager_cut_short(unraisable.exc_value):
        return
    sys.__unraisablehook__(unraisable)


def quiet_shutdown() -> None:
    """Keep hivemind's known shutdown races out of the output, so that leaving the swarm prints no traceback. Call it
    before starting the DHT: its processes are forked and inherit the filters."""
    for name in ("hivemind.dht.dht", "asyncio"):
        logger_ = logging.getLogger(name)
        if not any(isinstance(f, _HarmlessRaceFilter) for f in logger_.filters):
            logger_.addFilter(_HarmlessRaceFilter())
    sys.unraisablehook = _quiet_unraisable


_leaving = threading.Event()  # set by the SIGTERM handler


def leave_on_sigterm() -> None:
    """SIGTERM (kill, a notebook's stop button) stops the process as cleanly as Ctrl-C: KeyboardInterrupt in the main
    process, so it says goodbye to its peers and shuts its DHT down. The handler raises directly (a shell starts
    background jobs with SIGINT ignored), and hivemind's forked processes keep the default: they just end."""
    main_pid = os.getpid()

    def leave(signum, frame):
        if os.getpid() != main_pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        _leaving.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, leave)
    sys.unraisablehook = _quiet_unraisable


def raise_if_leaving() -> None:
    """Raise the KeyboardInterrupt of a SIGTERM that Python swallowed. The handler's exception is lost when the signal
    lands in a fork hook or a finalizer (a DHT or averager starting its process), so long loops call this."""
    if _leaving.is_set():
        raise KeyboardInterrupt


@contextlib.contextmanager
def keeping_sigint() -> Iterator[None]:
    """Start hivemind averagers inside this: DecentralizedAverager.run_in_background sets SIGINT to "ignore" in the
    process that starts it (meant for its own process), after which Ctrl-C would no longer stop a peer or the
    coordinator. Whatever handled SIGINT before is put back."""
    handler = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        if handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, handler)


def run_role(work: Callable[[], int], farewell: str) -> NoReturn:
    """The main() of a role, which ends its process: log to stderr, leave on SIGTERM or Ctrl-C with `farewell` and
    exit code 0, else with `work`'s code (`end_process`). SIGUSR1 prints every thread's stack to stderr, in this
    process and in those it forks (its DHT's, its averagers'): what a role that hangs is waiting for."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("lightning.pytorch").propagate = False  # it prints its own messages already
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    leave_on_sigterm()
    try:
        code = work()
    except KeyboardInterrupt:
        print(farewell, flush=True)
        code = 0
    end_process(code)


def end_process(code: int) -> NoReturn:
    """Exit as the interpreter does, without its finalization. Daemon threads may be inside torch when a role leaves
    (hivemind's averager serialises this peer's state for a peer downloading it from a thread of the main process):
    finalization ends such a thread where it takes the GIL back, in a C++ destructor, and the process aborts
    ("terminate called without an active exception", exit code -6, after the goodbye). It would also walk every
    object of torch, Lightning and hivemind in full garbage collections (seconds of CPU before the prompt returns).
    So the interpreter's own first steps run, and then the process ends at once."""
    threading._shutdown()  # joins the threads that are not daemons, after telling thread pools to stop (stdlib's)
    atexit._run_exitfuncs()  # multiprocessing ends and joins hivemind's processes; logging flushes its handlers
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def start_dht(options: DHTOptions, while_connecting: Callable[[], None] = lambda: None) -> hivemind.DHT:
    """Start a DHT peer and wait until it has joined the swarm. `while_connecting` runs in this process meanwhile:
    after the DHT's process has forked (a fork must not copy a half-done import of another thread), before it is
    ready."""
    quiet_shutdown()
    initial_peers = resolve_initial_peers(options.initial_peers)
    host_maddrs = parse_multiaddrs(options.host_maddrs, "host address")
    announce_maddrs = parse_multiaddrs(options.announce_maddrs, "announce address")
    check_port_free(host_maddrs)
    try:
        dht = hivemind.DHT(
            initial_peers=initial_peers,
            host_maddrs=host_maddrs,
            announce_maddrs=announce_maddrs or None,
            identity_path=options.identity_path,
            client_mode=options.client_mode,
            use_relay=options.use_relay,
            use_auto_relay=options.use_auto_relay,
            startup_timeout=options.startup_timeout,
            authorizer=options.authorizer,
            start=False,
        )
        dht.start()
        while_connecting()
        dht.wait_until_ready()
    except P2PDaemonError as e:
        raise daemon_start_error(e, initial_peers) from None
    except RuntimeError as e:  # connected, but no initial peer answered a DHT request
        if "bootstrap failed" not in str(e):
            raise
        raise SwarmError(
            "the initial peers refused this peer's requests. " + (
                "This run is private: join with the --token the coordinator issued for you (issue-token)."
                if options.authorizer is None else
                "Is your --token for this run? A token signed for another run (or by another coordinator key)"
                " gets no answer.")
        ) from None
    return dht


def withdraw_records(dht: hivemind.DHT, tracker: Any, averagers: list[Any], timeout: float = LEAVE_TIMEOUT) -> bool:
    """A clean leave, before the averagers and the DHT shut down: overwrite this peer's progress record and its offers
    to share state with empty ones, stop `tracker` while they travel, and wait until the DHT has taken them. The others
    then stop counting this peer at their next look (a round's target, a group, a state download) instead of when its
    records lapse. hivemind's own goodbye (ProgressTracker.shutdown) stores the progress without waiting, only after
    its loops have ended, and the DHT may be gone before it lands; its averagers never withdraw their offer. Returns
    whether every record was withdrawn in time."""
    expiration = get_dht_time() + RECORD_LIFETIME + WITHDRAWAL_MARGIN
    stores = []
    if tracker is not None:
        stores.append(dht.store(tracker.training_progress_key, subkey=progress_subkey(tracker), value=None,
                                expiration_time=expiration, return_future=True))
    for averager in averagers:
        averager.allow_state_sharing = False  # its own process stops re-declaring the offer
        stores.append(dht.store(f"{averager.prefix}.all_averagers", subkey=averager.peer_id.to_bytes(), value=None,
                                expiration_time=expiration, return_future=True))
    deadline = time.monotonic() + timeout
    if tracker is not None:
        tracker.shutdown()  # waits for its loops to end: a live report stored meanwhile loses to the withdrawal
    try:
        return all([future.result(timeout=max(0.0, deadline - time.monotonic())) for future in stores])
    except Exception as e:  # the DHT already gone (a Ctrl-C that reached it too), a timeout: the records lapse instead
        logger.debug(f"Could not withdraw this peer's records: {e!r}")
        return False


FORGET_PEERS_AFTER = 600.0  # seconds: a peer gone this long is not dialled again
_seen_peers: dict[PeerID, float] = {}  # in the DHT's process: every DHT peer this node has known, and when


async def _reconnect(maddrs: list[str], dht: hivemind.DHT, node) -> int:
    """Inside the DHT's process: ping the initial peers this node is not connected to, and the peers it knew that have
    dropped out of its routing table, so that both sides add each other again. A DHT removes a peer at its first
    unanswered request; after a network cut or the coordinator's death, two volunteers that only met through others
    would otherwise never find each other again (their averaging and progress keys would no longer meet). The P2P
    daemon keeps the addresses of peers it was connected to and dials them itself. Returns how many came back."""
    now = time.monotonic()
    in_table = routing_table_peers(node)
    _seen_peers.update({peer_id: now for peer_id in in_table})
    for peer_id, seen in list(_seen_peers.items()):
        if now - seen > FORGET_PEERS_AFTER:
            del _seen_peers[peer_id]
    connected = {info.peer_id for info in await node.p2p.list_peers()}
    initial = [PeerID.from_base58(Multiaddr(maddr)["p2p"]) for maddr in maddrs]
    targets = {peer_id for peer_id in initial if peer_id not in connected}
    targets |= {peer_id for peer_id in _seen_peers if peer_id not in in_table and peer_id != node.peer_id}
    answers = await asyncio.gather(*(ping(node, peer_id) for peer_id in targets), return_exceptions=True)
    return sum(1 for answer in answers if answer is True)


class StayConnected(threading.Thread):
    """Dials the initial peers again whenever the connection is lost, and the swarm's peers this one lost touch with.
    A coordinator that restarts (same identity and port) starts a fresh DHT that knows nobody: without this, the peers
    would train on but it would never see them again. Runs until the DHT shuts down."""

    def __init__(self, dht: hivemind.DHT, initial_peers: list[str], every: float = 10.0):
        super().__init__(name="stay-connected", daemon=True)
        self.dht, self.every = dht, every
        self.initial_peers = [m for m in initial_peers if "/p2p/" in m]

    def run(self) -> None:
        while self.dht.is_alive():
            time.sleep(self.every)
            try:
                reached = self.dht.run_coroutine(partial(_reconnect, self.initial_peers), return_future=True).result(
                    timeout=self.every * 3)
            except Exception:  # the DHT is shutting down, or the dial hung: the next round tries again
                continue
            if reached:
                logger.info(f"Reconnected to {reached} peer(s)")


def _is_loopback(maddr: Multiaddr) -> bool:
    for protocol, value in maddr.items():
        if protocol.name in ("ip4", "ip6"):
            return ipaddress.ip_address(value).is_loopback
    return False


def visible_addresses(dht: hivemind.DHT) -> tuple[list[str], bool]:
    """The addresses other machines can dial, and whether only loopback addresses exist."""
    maddrs = dht.get_visible_maddrs()
    outside = [str(m) for m in maddrs if not _is_loopback(m)]
    return (outside, False) if outside else ([str(m) for m in maddrs], True)


# How a volunteer starts a peer: from a clone of the repository, or where HiveTrain is pip-installed
CLONE_JOIN, INSTALLED_JOIN = "python peers/join.py", "hivetrain-join"


def join_command(addresses: list[str], extra: str = "", program: str = CLONE_JOIN) -> str:
    return f"{program} --initial-peers {' '.join(shlex.quote(a) for a in addresses)}{extra}"


def read_records(dht: hivemind.DHT, key: str, schema: type[Record], timeout: float = DHT_READ_TIMEOUT) -> list[Record]:
    """Every live entry under a DHT key with subkeys, each parsed with `schema`. What a reader cannot use (a malformed
    or unsigned entry, one expiring far ahead, a plain value in place of the entries) is skipped with a rate-limited
    warning, a cleared entry (None: its owner left) silently: nothing a peer wrote stops the reader."""
    return [record for _, record in read_signed_records(dht, key, schema, timeout)]


def read_signed_records(dht: hivemind.DHT, key: str, schema: type[Record],
                        timeout: float = DHT_READ_TIMEOUT) -> list[tuple[bytes, Record]]:
    """read_records, each record with the subkey it was stored under: its writer's public key, which signed it."""
    return [(subkey, record) for subkey, _, record in usable_entries(key, _read_entries(dht, key, timeout), schema)]


def _read_entries(dht: hivemind.DHT, key: str, timeout: float) -> Any:
    """What a read of `key` found (the per-peer entries of a key with subkeys), or None."""
    try:  # a reply hivemind cannot decode leaves its future unresolved: never wait on it forever
        found = dht.get(key, latest=True, return_future=True).result(timeout=timeout)
    except TimeoutError:
        logger.warning(f"Reading {key} from the DHT timed out")
        return None
    return found.value if found is not None else None
