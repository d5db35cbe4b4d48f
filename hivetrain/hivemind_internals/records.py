"""hivemind's record formats: a progress tracker with a hook on the records it reads, a peer's own progress
record, and signed records (the signature formats, keys, identities, signing)."""

from __future__ import annotations

import os
import re
import threading
import time
from typing import Any, Optional

import hivemind
from google.protobuf.message import DecodeError
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.optim.progress_tracker import GlobalTrainingProgress, ProgressTracker
from hivemind.p2p import P2P
from hivemind.proto import crypto_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey


# --- progress records ---------------------------------------------------------------------------------------------

# Seconds between two stores of a peer's progress record within one epoch. Stored at once: a new epoch or samples reset,
# the first samples of an epoch (hivemind's reporter stops storing a peer's record once two epochs passed without a
# stored record with samples), and the report with which the swarm's samples reach the target as this peer counts them
# (the others learn at their next read that the epoch or round is due). hivemind stores it at every report, that is
# at every step: up to 35 stores a second per peer on the demo, each signed, sent, and verified by every DHT node it
# reaches. Readers extrapolate a record by the rate it states, and read no more often than hivemind's
# min_refresh_period (0.5 s).
PROGRESS_STORE_EVERY = 0.5


class _ReportDue(threading.Event):
    """The event on which hivemind's progress reporter stores a peer's record (its should_report_progress), set at most
    every `every` seconds: a set() that comes sooner is held, and sets it when due. set_now() sets it at once (and
    drops a held one)."""

    def __init__(self, every: float):
        super().__init__()
        self.every, self._set_at, self._lock = every, -float("inf"), threading.Lock()
        self._held: Optional[threading.Timer] = None
        self._closed = False

    def set(self) -> None:
        with self._lock:
            wait = 0 if self._closed else self._set_at + self.every - time.monotonic()
            if wait > 0:
                if self._held is None or self._held.finished.is_set():
                    self._held = threading.Timer(wait, self.set_now)
                    self._held.daemon = True
                    self._held.start()
                return
        self.set_now()

    def set_now(self) -> None:
        with self._lock:
            if self._held is not None:
                self._held.cancel()  # what it held back is stored now
            self._set_at = time.monotonic()
            super().set()

    def close(self) -> None:
        """From now on, set() sets it at once (the tracker is shutting down: its reporter wakes on it to end)."""
        with self._lock:
            self._closed = True
        self.set_now()


class HookedProgressTracker(ProgressTracker):
    """hivemind's ProgressTracker with a public hook on every read of the swarm's progress records (hivemind parses
    them in its private _parse_swarm_progress_data, in the constructor too, with no other place to look at them
    first), whose record is stored at most every PROGRESS_STORE_EVERY seconds within an epoch."""

    @property
    def should_report_progress(self) -> _ReportDue:
        return self._report_due

    @should_report_progress.setter
    def should_report_progress(self, event: threading.Event) -> None:
        # hivemind's __init__ makes it a plain Event, which its reports set at every step
        self._report_due = _ReportDue(PROGRESS_STORE_EVERY)

    def report_local_progress(self, local_epoch: int, samples_accumulated: int, update_global_samples: bool = True):
        before = self.local_progress
        at_once = (local_epoch != before.epoch or samples_accumulated < before.samples_accumulated
                   or before.samples_accumulated == 0 < samples_accumulated)
        was_due = self._target_reached()
        super().report_local_progress(local_epoch, samples_accumulated, update_global_samples)
        if at_once or (self._target_reached() and not was_due):
            self.should_report_progress.set_now()

    def _target_reached(self) -> bool:
        return self.global_progress.samples_accumulated >= self.target_batch_size

    def shutdown(self, timeout: Optional[float] = None):
        self.shutdown_triggered.set()
        self.should_report_progress.close()  # its reporter wakes on it to end, not when a held report is due
        return super().shutdown(timeout)

    def before_parsing_progress(self, metadata: Any) -> Any:
        """The progress records as read from the DHT, before hivemind parses them: a subclass may inspect or filter
        them (and must return what hivemind is to parse)."""
        return metadata

    def _parse_swarm_progress_data(self, metadata) -> GlobalTrainingProgress:
        return super()._parse_swarm_progress_data(self.before_parsing_progress(metadata))

    def fetch_soon(self) -> None:
        """Read the swarm's progress records again within min_refresh_period, not when hivemind planned at its last
        read. hivemind plans the next read at a share of the estimated time to the next epoch, from the peers' rates
        in their records, which are near zero before their first steps: the plan then lies up to max_refresh_period
        (10 s) ahead, and the diloco rounds that began meanwhile counted this peer's own samples only (rounds of 2H
        inner steps for 2 peers in a probe, where H steps took 0.6 s). Call it under pause_updates(), as update_epoch
        is called: hivemind's reader replaces global_progress under that lock."""
        self.global_progress.next_fetch_time = min(self.global_progress.next_fetch_time,
                                                   get_dht_time() + self.min_refresh_period)
        self.global_state_updated.set()  # hivemind's reader waits on it: it wakes, and waits anew to the time above


def progress_subkey(tracker: ProgressTracker) -> bytes:
    """The subkey under which this peer's tracker stores its progress record (its signing key's public part): the only
    way to overwrite that record, e.g. to withdraw it on leaving. hivemind keeps it private."""
    return tracker._local_public_key


def announce_and_count_peers(dht: hivemind.DHT, tracker: ProgressTracker) -> int:
    """Publish this peer's progress with no samples yet and read everyone's into its tracker; return the training
    peers counted. hivemind publishes a peer's progress only once it has samples and has no public call for either
    half: its tracker builds the record (_get_local_progress) and parses the swarm's (_parse_swarm_progress_data)
    privately."""
    own = tracker._get_local_progress(tracker.local_progress.epoch, samples_accumulated=0)
    dht.store(tracker.training_progress_key, subkey=progress_subkey(tracker), value=own.dict(),
              expiration_time=get_dht_time() + tracker.metadata_expiration)
    found = dht.get(tracker.training_progress_key, latest=True)
    with tracker.lock_global_progress:
        tracker.global_progress = tracker._parse_swarm_progress_data(found.value if found is not None else None)
    tracker.global_state_updated.set()  # its fetcher plans its next look from this progress
    return tracker.global_progress.num_peers


# --- signed records -----------------------------------------------------------------------------------------------

SIGNED_SUBKEY_RE: re.Pattern = RSASignatureValidator._PUBLIC_KEY_RE  # b"[owner:<public key>]", a signed subkey
SIGNATURE_RE: re.Pattern = RSASignatureValidator._SIGNATURE_RE  # the signature appended to a signed value


def signature_checker() -> RSASignatureValidator:
    """An RSASignatureValidator that verifies signatures and can sign nothing. Its validate checks a signature with
    class attributes only; made without __init__ (which would load or generate a private key) it holds no key."""
    return RSASignatureValidator.__new__(RSASignatureValidator)


def rsa_key_from_der(data: bytes) -> RSAPrivateKey:
    """hivemind's RSAPrivateKey holding a DER-encoded key. hivemind loads keys only from its own pickled form or
    generates them; its key object wraps a `cryptography` key in a private attribute."""
    from cryptography.hazmat.primitives import serialization

    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key._private_key = serialization.load_der_private_key(data, password=None)
    return key


def identity_key(path: str) -> RSAPrivateKey:
    """The RSA key of the peer identity file at `path` (hivemind's P2P keeps a libp2p PrivateKey protobuf there; the
    peer ID is its public part's hash), created as P2P would when the file does not exist yet."""
    if not os.path.exists(path):
        P2P.generate_identity(path)
    with open(path, "rb") as file:
        data = file.read()
    try:
        stored = crypto_pb2.PrivateKey.FromString(data)
        if stored.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError
        return rsa_key_from_der(stored.data)
    except (DecodeError, ValueError):
        raise ValueError(f"{path} is not a peer identity (a libp2p RSA private key, as hivemind writes them)") from None


def write_identity(key: RSAPrivateKey, path: str) -> None:
    """Keep `key` as a peer identity file at `path`, in the form identity_key reads and hivemind's P2P starts with."""
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400), "wb") as file:
        file.write(crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=key.to_bytes()).SerializeToString())


def sign_records_with(key: RSAPrivateKey) -> None:
    """Make `key` this process's record-signing key: hivemind's RSAPrivateKey.process_wide(), which every
    RSASignatureValidator() made without a key signs with (the run record, rollback records). hivemind generates that
    key afresh in each process and offers no way to set it. Call it before the first validator is made."""
    current = RSAPrivateKey._process_wide_key
    if current is not None and current.to_bytes() != key.to_bytes():
        raise RuntimeError("this process already signs records with another key")
    RSAPrivateKey._process_wide_key = key


