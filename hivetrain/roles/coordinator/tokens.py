"""A private run's tokens on its owner's machine: `issue-token` and `revoke-token` (coordinator/start.py's
subcommands), the files beside the authority key that remember them, and the coordinator's watch on the revocation
file.

Beside `authority.key` (any name: `<name>.key`) live two JSON files, readable by their owner only:

- `authority.issued.json`: each token issue-token printed, by name, expiry and holder fingerprint (no secret), so
  that revoke-token can find a volunteer's tokens by the name alone;
- `authority.revoked.json`: the grants revoke-token revoked. The coordinator reads it at start and again whenever it
  changes (RevocationWatch, polled from its main loop), refuses their holders at once and publishes the list for its
  peers (hivetrain.revocation). An entry whose grant has expired is dropped: the grant is refused anyway.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable, Optional

import hivemind

from hivetrain.access import (OLD_TOKEN_PREFIXES, TOKEN_PREFIX, AccessGrant, holder_fingerprint, issue_grant, load_key,
                              parse_lifetime)
from hivetrain.config import DEFAULT_PRESET, PRESETS, get_preset
from hivetrain.files import atomic_write
from hivetrain.revocation import (MAX_REVOKED, REVOCATION_TTL, WATCH_REVOCATIONS_EVERY, apply_revocations,
                                  publish_revocations)

logger = logging.getLogger(__name__)

CHECK_FILE_EVERY = 1.0  # seconds between the coordinator's looks at the revocation file (a stat)
PUBLISH_RETRY = 5.0  # seconds before the coordinator publishes again a list the DHT refused


def authority_path(authority_key: str | None, run_id: str) -> Path:
    return Path(authority_key or Path.home() / ".cache" / "hivetrain" / run_id / "authority.key")


def issued_path(authority: Path) -> Path:
    return authority.with_name(f"{authority.stem}.issued.json")


def revocation_path(authority: Path) -> Path:
    # Named after the key, not one `revoked.json` per folder: two runs' keys may share one.
    return authority.with_name(f"{authority.stem}.revoked.json")


@dataclass(frozen=True)
class GrantNote:
    """What the owner's machine remembers of a grant: whom it is for, until when, and its holder fingerprint (what
    a revocation names: hivetrain.access.holder_fingerprint)."""

    name: str
    expires: int
    holder: bytes

    @classmethod
    def of(cls, grant: AccessGrant) -> GrantNote:
        return cls(grant.name, grant.expires, holder_fingerprint(grant.holder))

    @property
    def expired(self) -> bool:
        return self.expires <= time.time()

    def until(self) -> str:
        return f"{datetime.fromtimestamp(self.expires):%Y-%m-%d %H:%M}"


def read_notes(path: Path, what: str) -> list[GrantNote]:
    """The unexpired grants listed in `path` (`what` it is, for messages): none when it does not exist. An entry that
    does not parse is skipped with one warning; a file that is no such list raises ValueError."""
    if not path.exists():
        return []
    try:
        entries = json.loads(path.read_text())["grants"]
        if not isinstance(entries, list):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a {what} ({type(e).__name__}): fix it, or remove it") from None
    notes, skipped = [], 0
    for entry in entries:
        try:
            note = GrantNote(name=str(entry["name"]), expires=int(entry["expires"]),
                             holder=bytes.fromhex(entry["holder"]))
        except (ValueError, KeyError, TypeError):
            skipped += 1
            continue
        if not note.expired:
            notes.append(note)
    if skipped:
        logger.warning(f"Skipped {skipped} malformed entr{'y' if skipped == 1 else 'ies'} of {path}")
    return notes


def write_notes(path: Path, notes: list[GrantNote]) -> None:
    entries = [dict(asdict(note), holder=note.holder.hex()) for note in notes]
    atomic_write(path, json.dumps(dict(grants=entries), indent=1) + "\n", mode=0o600)


def revoked_holders(authority: Path) -> frozenset[bytes]:
    """The holder fingerprints revoked for the run of `authority` (its revocation file), for the coordinator's
    authorizer at start. Raises ValueError when the file is no revocation list."""
    return frozenset(note.holder for note in read_notes(revocation_path(authority), "revocation list"))


def _token_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default=DEFAULT_PRESET,
                        help="the run's preset, to find its default run id (default: %(default)s)")
    parser.add_argument("--run-id", help="the run's id, as given to the coordinator (default: the preset's)")
    parser.add_argument("--authority-key", default=None, metavar="FILE",
                        help="the run's authority key (default: ~/.cache/hivetrain/<run-id>/authority.key)")


def issue_token_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python coordinator/start.py issue-token",
        description="Print an access token for one volunteer of a private run (started with --require-token). The"
                    " volunteer joins with --token TOKEN (or HIVETRAIN_TOKEN=TOKEN).",
    )
    parser.add_argument("name", help="who the token is for (their display name in the swarm)")
    parser.add_argument("--expires", default="7d", help="lifetime: 30m, 12h, 7d, 2w (default: %(default)s)")
    _token_arguments(parser)
    return parser


def issue_token(argv: list[str]) -> int:
    args = issue_token_parser().parse_args(argv)
    try:
        lifetime = parse_lifetime(args.expires)
        path = authority_path(args.authority_key, args.run_id or get_preset(args.preset).run_id)
        grant = issue_grant(load_key(path), args.name, lifetime)
        log = issued_path(path)
        write_notes(log, [*read_notes(log, "list of issued tokens"), GrantNote.of(grant)])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(grant.encode())
    print(f"Token for {grant.name}, valid until {GrantNote.of(grant).until()}, signed with {path}", file=sys.stderr)
    return 0


def revoke_token_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python coordinator/start.py revoke-token",
        description="Revoke a volunteer's token before it expires: the run's coordinator refuses its holder within"
                    " seconds, and so does every peer once it has read the coordinator's list.",
    )
    parser.add_argument("name_or_token", metavar="NAME_OR_TOKEN",
                        help="the name given to issue-token (every unexpired token of that name), or the token itself")
    _token_arguments(parser)
    return parser


def revoke_token(argv: list[str]) -> int:
    args = revoke_token_parser().parse_args(argv)
    try:
        path = authority_path(args.authority_key, args.run_id or get_preset(args.preset).run_id)
        line = revoke(path, args.name_or_token)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(line)
    return 0


def revoke(authority: Path, name_or_token: str) -> str:
    """Add the grants `name_or_token` names to the revocation file of `authority`; returns the line to print.
    Raises ValueError, saying why, when it names none of this key's unexpired grants or the list is full."""
    if not authority.exists():
        raise ValueError(f"there is no authority key at {authority}: give the run's --run-id or --authority-key")
    if name_or_token.startswith((TOKEN_PREFIX, *OLD_TOKEN_PREFIXES)):
        grant = AccessGrant.decode(name_or_token)
        if grant.authority != load_key(authority).get_public_key().to_bytes():
            raise ValueError(f"this token (for {grant.name}) was not signed with {authority}: it is another run's")
        targets, who = [GrantNote.of(grant)], f"the token for {grant.name}"
        if grant.expired:
            return f"The token for {grant.name} expired on {targets[0].until()}: it is refused anyway"
    else:
        issued = read_notes(issued_path(authority), "list of issued tokens")
        targets, who = [note for note in issued if note.name == name_or_token], f"{name_or_token}'s tokens"
        if not targets:
            raise ValueError(f"no unexpired token for {name_or_token!r} was issued with {authority} (one issued"
                             f" before revoke-token existed is revoked by giving the token itself)")
    file = revocation_path(authority)
    revoked = read_notes(file, "revocation list")
    known = {note.holder for note in revoked}
    new = [note for note in targets if note.holder not in known]
    if not new:
        return f"Revoked already: {who} ({file})"
    if len(revoked) + len(new) > MAX_REVOKED:
        raise ValueError(f"{file} holds {len(revoked)} revoked tokens that have not expired, and a list holds at most"
                         f" {MAX_REVOKED}: issue shorter tokens, or start the run anew with another authority key")
    write_notes(file, revoked + new)
    until = max(new, key=lambda note: note.expires).until()
    return (f"Revoked {len(new)} token{'s' * (len(new) > 1)} for {new[0].name} (valid until {until}): the"
            f" coordinator refuses {'them' if len(new) > 1 else 'it'} within {CHECK_FILE_EVERY:.0f} s, its peers"
            f" within {CHECK_FILE_EVERY + WATCH_REVOCATIONS_EVERY:.0f} s or so ({file})")


def _file_stamp(path: Path) -> Optional[tuple[int, int, int]]:
    # atomic_write replaces the file: a new inode even when two writes share an mtime and a size
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


class RevocationWatch:
    """The coordinator's watch on its revocation file: `poll()`, called from its main loop, looks at the file every
    CHECK_FILE_EVERY seconds; when it changed, the coordinator's authorizer takes the new list at once, and the list
    is published (hivetrain.revocation), again every third of its lifetime. A file that no longer parses keeps the
    list read before, with a warning.

    Args:
        dht: the coordinator's DHT node (with its RunAuthorizer).
        run_id: the run.
        authority: the run's authority key file; the revocation file lies beside it (revocation_path).
        report: prints a line for the run's owner.
    """

    def __init__(self, dht: hivemind.DHT, run_id: str, authority: Path, report: Callable[[str], None] = print):
        self.dht, self.run_id, self.path, self.report = dht, run_id, revocation_path(authority), report
        self.revoked: list[GrantNote] = []
        self.stamp: Optional[tuple[int, int, int]] = None
        self.next_check = self.next_publish = 0.0

    def poll(self) -> None:
        now = time.monotonic()
        if now < self.next_check:
            return
        self.next_check = now + CHECK_FILE_EVERY
        stamp = _file_stamp(self.path)
        if stamp != self.stamp:
            self.stamp = stamp
            self._reload()
            self.next_publish = now
        if now >= self.next_publish:
            # The grants that expired since are left out: their holders are refused anyway.
            holders = [note.holder for note in sorted(self.revoked, key=lambda note: -note.expires) if not note.expired]
            published = publish_revocations(self.dht, self.run_id, holders[:MAX_REVOKED])
            self.next_publish = now + (REVOCATION_TTL / 3 if published else PUBLISH_RETRY)

    def _reload(self) -> None:
        try:
            revoked = read_notes(self.path, "revocation list")
        except ValueError as e:
            logger.warning(f"{e}; the {len(self.revoked)} revocation(s) read before stand")
            return
        if len(revoked) > MAX_REVOKED:
            logger.warning(f"{self.path} revokes {len(revoked)} tokens: the peers learn of the {MAX_REVOKED} that"
                           f" expire last (the coordinator refuses them all)")
        if {note.holder for note in revoked} != {note.holder for note in self.revoked}:
            apply_revocations(self.dht, [note.holder for note in revoked])
            names = sorted({note.name for note in revoked})
            self.report(f"Revoked tokens: {len(revoked)}{' (' + ', '.join(names[:10]) + ')' if names else ''}"
                        f"{', ...' if len(names) > 10 else ''}, from {self.path}")
        self.revoked = revoked


TOKEN_COMMANDS = {"issue-token": issue_token, "revoke-token": revoke_token}
