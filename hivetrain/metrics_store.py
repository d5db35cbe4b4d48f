"""The metrics store of a run: one SQLite file the coordinator writes and the dashboard and tests read.

One writer (the coordinator, guarded by an flock on `<path>.lock`), any number of readers. WAL mode lets readers
see each commit while the writer keeps going; readers open the file read-only, so a dashboard can never damage it.
"""

import fcntl
import math
import os
import sqlite3
import threading
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterator, Optional, Self, TextIO, TypeVar
from urllib.parse import quote

# 2: the peers' diloco figures (inner steps, pseudo-gradient norm, bytes per round); 3: their training and swarm time;
# 4: when the monitor saw a peer leave, and its diloco rounds (averaged, alone, failed); 5: the coordinator's rollbacks
SCHEMA_VERSION = 5
BUSY_TIMEOUT = 5.0  # seconds a connection waits for a lock held by the other side
T = TypeVar("T")

SCHEMA = [
    "CREATE TABLE IF NOT EXISTS run (run_id TEXT, preset TEXT, fingerprint TEXT,"
    " config_json TEXT, join_command TEXT, coordinator_peer_id TEXT, started REAL)",
    "CREATE TABLE IF NOT EXISTS peers (peer_id TEXT PRIMARY KEY, name TEXT, hardware TEXT, client_mode INTEGER,"
    " epoch INTEGER, samples_per_second REAL, loss REAL, samples INTEGER, first_seen REAL, last_seen REAL,"
    " inner_steps INTEGER, pseudo_gradient_norm REAL, round_bytes INTEGER, train_seconds REAL, swarm_seconds REAL,"
    " left_at REAL, rounds_averaged INTEGER, rounds_alone INTEGER, rounds_failed INTEGER)",
    "CREATE TABLE IF NOT EXISTS snapshots (time REAL, epoch INTEGER, alive_peers INTEGER, clients INTEGER,"
    " samples_per_second REAL, samples_accumulated INTEGER, target_batch_size INTEGER, eta_seconds REAL,"
    " mean_loss REAL)",
    "CREATE INDEX IF NOT EXISTS snapshots_time ON snapshots (time)",
    "CREATE TABLE IF NOT EXISTS validations (time REAL, epoch INTEGER, loss REAL, top1 REAL, top5 REAL,"
    " samples INTEGER)",
    "CREATE TABLE IF NOT EXISTS checkpoints (time REAL, epoch INTEGER, uri TEXT, size_bytes INTEGER, top1 REAL,"
    " best INTEGER)",
    "CREATE TABLE IF NOT EXISTS rollbacks (time REAL, sequence INTEGER, epoch INTEGER, top1 REAL, loss REAL,"
    " best_epoch INTEGER, best_top1 REAL, restored_epoch INTEGER)",
]


class StoreError(RuntimeError):
    """A problem with the store; the message is shown to users as is."""


class StoreMissing(StoreError):
    """The store file does not exist (yet)."""


class StoreBusy(StoreError):
    """Another writer holds the store."""


@dataclass
class RunInfo:
    run_id: str
    preset: str
    fingerprint: str
    config_json: str
    join_command: str
    coordinator_peer_id: str
    started: float  # unix time


@dataclass
class PeerRow:
    peer_id: str
    name: str
    hardware: str
    client_mode: bool
    epoch: int
    samples_per_second: float
    loss: float | None
    samples: int  # total contributed
    first_seen: float  # unix time
    last_seen: float  # unix time
    inner_steps: int | None = None  # diloco: inner steps since the peer's last outer round
    pseudo_gradient_norm: float | None = None  # diloco: of its pseudo-gradient in its last round
    round_bytes: int | None = None  # diloco: bytes it sent in its last round (estimated)
    train_seconds: float | None = None  # wall time since its first local step
    swarm_seconds: float | None = None  # of which in swarm rounds and state downloads
    # unix time of the first look that found the peer gone (it said goodbye, or its record lapsed); None while it is in
    left_at: float | None = None
    rounds_averaged: int | None = None  # diloco: outer rounds it averaged with others,
    rounds_alone: int | None = None  # found no one to average with,
    rounds_failed: int | None = None  # or whose all-reduce failed


@dataclass
class SwarmSnapshot:
    time: float
    epoch: int
    alive_peers: int
    clients: int
    samples_per_second: float
    samples_accumulated: int
    target_batch_size: int
    eta_seconds: float | None
    mean_loss: float | None


@dataclass
class ValidationRow:
    time: float
    epoch: int
    loss: float
    top1: float
    top5: float
    samples: int


@dataclass
class CheckpointRow:
    time: float
    epoch: int
    uri: str
    size_bytes: int
    top1: float | None
    best: bool


@dataclass
class RollbackRow:
    """The coordinator sent the swarm back to its best validated state: the validation at swarm epoch `epoch` saw
    `top1` (or a non-finite `loss`), and the best checkpoint's state (of `best_epoch`) went out as `restored_epoch`."""

    time: float
    sequence: int  # the rollback record's: 1, 2, ... in a run
    epoch: int
    top1: float
    loss: float
    best_epoch: int
    best_top1: float
    restored_epoch: int


def _columns(cls: type) -> str:
    return ", ".join(f.name for f in fields(cls))


def _insert(table: str, cls: type) -> str:
    return f"INSERT INTO {table} ({_columns(cls)}) VALUES ({', '.join('?' * len(fields(cls)))})"


def _values(row: object) -> tuple:
    """NaN becomes NULL: a peer may report a NaN loss, and SQLite would turn it into NULL silently anyway."""
    values = (getattr(row, f.name) for f in fields(row))
    return tuple(None if isinstance(v, float) and math.isnan(v) else v for v in values)


def _build(cls: type[T], values: tuple) -> T:
    """Booleans come back from 0/1; a NULL in a float that cannot be None was a NaN, so it reads back as NaN."""
    converted = []
    for f, value in zip(fields(cls), values):
        if f.type is bool:
            value = bool(value)
        elif f.type is float and value is None:
            value = math.nan
        converted.append(value)
    return cls(*converted)


def _check_version(path: Path, version: int) -> None:
    if version != SCHEMA_VERSION:
        raise StoreError(f"{path} has metrics schema version {version}, this HiveTrain uses version {SCHEMA_VERSION}")


class _Closing:
    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MetricsWriter(_Closing):
    """The coordinator's handle. Thread-safe: the monitor loop and the validation thread both write through it."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._lock_file = self._take_lock()
        self.connection = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT, isolation_level=None,
                                          check_same_thread=False)
        try:
            self.connection.execute("PRAGMA journal_mode=WAL")
            self.connection.execute("PRAGMA synchronous=NORMAL")
            with self._transaction() as db:
                db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER)")
                if row := db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone():
                    _check_version(self.path, row[0])  # before creating tables another version may not have
                for statement in SCHEMA:
                    db.execute(statement)
                db.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (SCHEMA_VERSION,))
        except BaseException:
            self.close()
            raise

    def _take_lock(self) -> TextIO:
        """Two coordinators writing one store would interleave two runs; the pid in the file names the holder."""
        lock_path = self.path.with_name(self.path.name + ".lock")
        lock_file = lock_path.open("a+")  # not "w": that would wipe the holder's pid before we know we may
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.close()
            pid = lock_path.read_text().strip() or "unknown"
            raise StoreBusy(f"{self.path} is written by another coordinator (pid {pid}); stop it or use another "
                            "metrics path") from None
        lock_file.truncate(0)
        lock_file.write(f"{os.getpid()}\n")
        lock_file.flush()
        return lock_file

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self.connection.execute("BEGIN IMMEDIATE")
            try:
                yield self.connection
            except BaseException:
                self.connection.execute("ROLLBACK")
                raise
            self.connection.execute("COMMIT")

    def last_counted_epoch(self, run_id: str) -> Optional[int]:
        """The swarm epoch of the last snapshot this store holds of run `run_id`, None when it holds none (a new store,
        or another run's)."""
        with self._lock:
            run = self.connection.execute("SELECT run_id FROM run").fetchone()
            if run is None or run[0] != run_id:
                return None
            return self.connection.execute("SELECT max(epoch) FROM snapshots").fetchone()[0]

    def set_run(self, info: RunInfo) -> None:
        """One row, replaced on every call: a restarted coordinator keeps the history in the other tables."""
        with self._transaction() as db:
            db.execute("DELETE FROM run")
            db.execute(_insert("run", RunInfo), _values(info))

    def upsert_peers(self, rows: list[PeerRow]) -> None:
        """Keyed by peer_id; a peer seen before keeps its earliest first_seen and, while its goodbye lingers, the
        time it left; everything else is replaced (a peer back under the same ID is in again)."""
        updates = ", ".join(f"{f.name} = excluded.{f.name}" for f in fields(PeerRow)
                            if f.name not in ("peer_id", "first_seen", "left_at"))
        with self._transaction() as db:
            db.executemany(f"{_insert('peers', PeerRow)} ON CONFLICT (peer_id) DO UPDATE SET {updates},"
                           " first_seen = min(first_seen, excluded.first_seen),"
                           " left_at = CASE WHEN excluded.left_at IS NULL THEN NULL"
                           " ELSE coalesce(left_at, excluded.left_at) END", [_values(row) for row in rows])

    def mark_left(self, present: set[str], at: float) -> None:
        """Every peer not in `present` that was in at the last look left at `at` (or its record lapsed before)."""
        with self._transaction() as db:
            db.execute(f"UPDATE peers SET left_at = ? WHERE left_at IS NULL AND peer_id NOT IN"
                       f" ({', '.join('?' * len(present))})", (at, *present))

    def add_snapshot(self, snapshot: SwarmSnapshot) -> None:
        with self._transaction() as db:
            db.execute(_insert("snapshots", SwarmSnapshot), _values(snapshot))

    def add_validation(self, row: ValidationRow) -> None:
        with self._transaction() as db:
            db.execute(_insert("validations", ValidationRow), _values(row))

    def add_checkpoint(self, row: CheckpointRow) -> None:
        """A new best checkpoint takes the flag from the previous one: there is one best."""
        with self._transaction() as db:
            if row.best:
                db.execute("UPDATE checkpoints SET best = 0 WHERE best")
            db.execute(_insert("checkpoints", CheckpointRow), _values(row))

    def add_rollback(self, row: RollbackRow) -> None:
        with self._transaction() as db:
            db.execute(_insert("rollbacks", RollbackRow), _values(row))

    def last_rollback_sequence(self) -> int:
        """The sequence number of the run's last rollback (0: none yet), so that a restarted coordinator counts on."""
        with self._lock:
            return self.connection.execute("SELECT coalesce(max(sequence), 0) FROM rollbacks").fetchone()[0]

    def close(self) -> None:
        """Closing the lock file releases the flock, so the next coordinator may open the store."""
        with self._lock:
            self.connection.close()
            self._lock_file.close()


class MetricsReader(_Closing):
    """A read-only view: opened with mode=ro, so a dashboard can never write, and never creates the file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.exists():
            raise StoreMissing(f"{self.path} does not exist (yet): no coordinator has written metrics there")
        # Autocommit: every query is its own read transaction and sees the writer's latest commit.
        # check_same_thread=False: Streamlit reruns the dashboard script on other threads.
        self.connection = sqlite3.connect(f"file:{quote(str(self.path))}?mode=ro", uri=True, timeout=BUSY_TIMEOUT,
                                          isolation_level=None, check_same_thread=False)

    def _ready(self) -> bool:
        """False while the writer has not created the schema yet: the dashboard then shows an empty run."""
        if not self.connection.execute("SELECT 1 FROM sqlite_master WHERE name = 'meta'").fetchone():
            return False
        _check_version(self.path, self.connection.execute(
            "SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0])
        return True

    def _select(self, cls: type[T], table: str, tail: str = "", params: tuple = ()) -> list[T]:
        if not self._ready():
            return []
        rows = self.connection.execute(f"SELECT {_columns(cls)} FROM {table} {tail}", params).fetchall()
        return [_build(cls, row) for row in rows]

    def run(self) -> RunInfo | None:
        return next(iter(self._select(RunInfo, "run")), None)

    def peers(self) -> list[PeerRow]:
        return self._select(PeerRow, "peers", "ORDER BY samples DESC, name")

    def snapshots(self, since: float | None = None) -> list[SwarmSnapshot]:
        """Snapshots after `since` (exclusive, so polling with the last time seen returns only new ones)."""
        since = -math.inf if since is None else since
        return self._select(SwarmSnapshot, "snapshots", "WHERE time > ? ORDER BY time, rowid", (since,))

    def latest_snapshot(self) -> SwarmSnapshot | None:
        return next(iter(self._select(SwarmSnapshot, "snapshots", "ORDER BY time DESC, rowid DESC LIMIT 1")), None)

    def latest_validation(self) -> ValidationRow | None:
        return next(iter(self._select(ValidationRow, "validations", "ORDER BY time DESC, rowid DESC LIMIT 1")), None)

    def validations(self) -> list[ValidationRow]:
        return self._select(ValidationRow, "validations", "ORDER BY time, rowid")

    def checkpoints(self) -> list[CheckpointRow]:
        return self._select(CheckpointRow, "checkpoints", "ORDER BY time, rowid")

    def rollbacks(self) -> list[RollbackRow]:
        return self._select(RollbackRow, "rollbacks", "ORDER BY time, rowid")

    def best_validation(self) -> ValidationRow | None:
        """Highest top-1; of equal ones the earliest."""
        return next(iter(self._select(ValidationRow, "validations", "ORDER BY top1 DESC, time, rowid LIMIT 1")), None)

    def close(self) -> None:
        self.connection.close()
