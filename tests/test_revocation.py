"""Revoked tokens (issue 27): the owner of a private run takes a volunteer's token back before it expires, and the
coordinator and every honest peer then refuse its holder; a revocation list signed by anyone but the coordinator
changes nothing."""

import json
import logging
import re
import time
from functools import partial

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import PeerID
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from conftest import start_coordinator
from hivetrain.roles.coordinator.start import main as coordinator_main
from hivetrain.roles.coordinator.tokens import (GrantNote, issued_path, read_notes, revocation_path, revoked_holders,
                                                write_notes)
from hivetrain.access import AccessGrant, RunAuthorizer, holder_fingerprint, issue_grant, load_key
from hivetrain.config import get_preset
from hivetrain.record_guard import MAX_RECORD_BYTES, parse_entry, signer_peer_id
from hivetrain.revocation import MAX_REVOKED, RevocationRecord, RevocationWatcher, revocation_key
from hivetrain.run_record import fetch_run

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
REFUSED_WITHIN = 30.0  # seconds: the coordinator looks at its file every second, the peers read its list every 0.5 s


def _run_cli(capsys, *argv: str) -> tuple[int, list[str], list[str]]:
    code = coordinator_main(list(argv))
    out, err = capsys.readouterr()
    return code, out.splitlines(), err.splitlines()


def _token_of(grant: AccessGrant) -> AccessToken:
    return AccessToken(username=grant.name, public_key=grant.holder, expiration_time=str(grant.expires),
                       signature=grant.signature)


def test_revoke_token_by_name_or_token_prints_one_line_and_writes_the_list(tmp_path, capsys):
    key = str(tmp_path / "authority.key")
    code, out, _ = _run_cli(capsys, "issue-token", "alice", "--authority-key", key)
    assert code == 0 and len(out) == 1
    alice = AccessGrant.decode(out[0])
    code, out, _ = _run_cli(capsys, "issue-token", "bob", "--authority-key", key)
    bob = AccessGrant.decode(out[0])
    assert [note.name for note in read_notes(issued_path(tmp_path / "authority.key"), "")] == ["alice", "bob"]

    code, out, err = _run_cli(capsys, "revoke-token", "alice", "--authority-key", key)
    assert code == 0 and err == [] and len(out) == 1 and out[0].startswith("Revoked 1 token for alice"), out
    listed = json.loads(revocation_path(tmp_path / "authority.key").read_text())["grants"]
    assert [(entry["name"], entry["holder"]) for entry in listed] == [("alice", holder_fingerprint(alice.holder).hex())]
    assert revocation_path(tmp_path / "authority.key").stat().st_mode & 0o777 == 0o600
    # By the token itself; twice is once.
    code, out, _ = _run_cli(capsys, "revoke-token", bob.encode(), "--authority-key", key)
    assert code == 0 and len(out) == 1 and out[0].startswith("Revoked 1 token for bob")
    code, out, _ = _run_cli(capsys, "revoke-token", bob.encode(), "--authority-key", key)
    assert code == 0 and len(out) == 1 and out[0].startswith("Revoked already")
    assert revoked_holders(tmp_path / "authority.key") == {holder_fingerprint(g.holder) for g in (alice, bob)}

    foreign = issue_grant(load_key(tmp_path / "other.key"), "eve", 3600).encode()
    for argument, message in (("carol", r"no unexpired token for 'carol' was issued with"),
                              (foreign, r"was not signed with .*authority\.key: it is another run's"),
                              ("ht2.e30", r"not a HiveTrain access token")):
        code, out, err = _run_cli(capsys, "revoke-token", argument, "--authority-key", key)
        assert (code, out, len(err)) == (2, [], 1) and err[0].startswith("error: "), err
        assert re.search(message, err[0]), err
    code, _, err = _run_cli(capsys, "revoke-token", "alice", "--authority-key", str(tmp_path / "missing.key"))
    assert code == 2 and len(err) == 1 and "there is no authority key at" in err[0]
    assert not (tmp_path / "missing.key").exists()  # revoking never makes a key


def test_a_revoked_grant_is_refused_and_the_list_is_bounded(tmp_path, caplog):
    authority = load_key(tmp_path / "authority.key")
    alice, bob = (issue_grant(authority, name, 3600) for name in ("alice", "bob"))
    own_key = RSAPrivateKey()
    coordinator = RunAuthorizer(issue_grant(authority, "coordinator", 3600, holder=own_key, with_key=False),
                                holder=own_key, revoked=[holder_fingerprint(alice.holder)])
    assert not coordinator.is_token_valid(_token_of(alice)) and coordinator.is_token_valid(_token_of(bob))
    coordinator.set_revoked([holder_fingerprint(bob.holder), holder_fingerprint(coordinator.grant.holder)])
    assert coordinator.is_token_valid(_token_of(alice)) and not coordinator.is_token_valid(_token_of(bob))
    assert coordinator.revoked == {holder_fingerprint(bob.holder)}  # never its own: hivemind asserts it valid

    # The file: expired grants and malformed entries drop out (one warning); a file that is no list is an error.
    path = tmp_path / "authority.revoked.json"
    write_notes(path, [GrantNote("alice", int(time.time()) + 60, b"a" * 12), GrantNote("old", 1, b"o" * 12)])
    raw = json.loads(path.read_text())
    raw["grants"] += [dict(name="x", expires="soon", holder="zz"), "nonsense"]
    path.write_text(json.dumps(raw))
    with caplog.at_level(logging.WARNING, logger="hivetrain.roles.coordinator.tokens"):
        assert [note.name for note in read_notes(path, "revocation list")] == ["alice"]
    assert [r.getMessage() for r in caplog.records] == [f"Skipped 2 malformed entries of {path}"]
    path.write_text("{not json")
    with pytest.raises(ValueError, match="is not a revocation list .*fix it, or remove it"):
        read_notes(path, "revocation list")

    # A full list fits in one record with room for its signature; one more fingerprint, or one of the wrong size,
    # does not parse.
    full = RevocationRecord(run_id="r" * 64, holders=[i.to_bytes(12, "big") for i in range(MAX_REVOKED)], time=1.0)
    assert len(MSGPackSerializer.dumps(full.dict())) < MAX_RECORD_BYTES - 2048
    for holders in ([b"x" * 12] * (MAX_REVOKED + 1), [b"short"], ["x" * 12]):
        assert parse_entry(RevocationRecord, dict(run_id="r", holders=holders, time=1.0))[1] is not None


async def _ping(peer_id: PeerID, _dht, node) -> bool:
    return await node.protocol.call_ping(peer_id) is not None


def _answers(dht: hivemind.DHT, peer_id: PeerID) -> bool:
    """Whether `peer_id` answers a ping from `dht` and `dht` takes the answer: both authorizers let the other pass."""
    return dht.run_coroutine(partial(_ping, peer_id))


def test_a_revoked_volunteer_is_refused_by_the_coordinator_and_the_honest_peers(spawn, tmp_path, capsys, cleanup,
                                                                               caplog, takeover_rows):
    """A private run: alice, bob and carol hold valid tokens and reach each other and the coordinator. carol, validly
    signed by her own key, publishes a revocation list revoking bob: alice's and bob's watchers ignore it (one warning
    each) and bob is still answered. The owner revokes alice: within REFUSED_WITHIN seconds the coordinator and bob
    refuse her requests and her answers, while bob and carol go on."""
    key = str(tmp_path / "authority.key")
    coordinator, addresses = start_coordinator(spawn, tmp_path, "--preset", "demo", "--require-token",
                                               "--authority-key", key, "--validate-every", "0", "--refresh", "1")
    coordinator_id = PeerID.from_base58(addresses[0].split("/p2p/")[1])
    run_id = get_preset("demo").run_id
    grants = {}
    for name in ("alice", "bob", "carol"):
        code, out, _ = _run_cli(capsys, "issue-token", name, "--authority-key", key)
        assert code == 0
        grants[name] = AccessGrant.decode(out[0])

    def volunteer(name: str, initial_peers: list[str], **others) -> hivemind.DHT:
        dht = hivemind.DHT(initial_peers=initial_peers, host_maddrs=LOOPBACK, start=True,
                           authorizer=RunAuthorizer(grants[name]), **others)
        cleanup.append(dht)
        return dht

    alice = volunteer("alice", addresses)
    bob = volunteer("bob", [*addresses, *map(str, alice.get_visible_maddrs())])
    forger = RSASignatureValidator(RSAPrivateKey())
    carol = volunteer("carol", [*addresses, *map(str, bob.get_visible_maddrs())], record_validators=[forger])
    def ignored() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "hivetrain.revocation"]

    watchers = []
    for dht in (alice, bob):
        run = fetch_run(dht, run_id, addresses, timeout=60)
        watchers.append(RevocationWatcher(dht, run_id, run.signer, every=0.5).start())
    try:
        assert all(_answers(dht, peer) for dht, peer in ((alice, coordinator_id), (alice, bob.peer_id),
                                                          (bob, alice.peer_id), (carol, bob.peer_id)))
        forged = RevocationRecord(run_id=run_id, holders=[holder_fingerprint(grants["bob"].holder)],
                                  time=get_dht_time() + 10**6)
        with caplog.at_level(logging.WARNING, logger="hivetrain.revocation"):
            assert carol.store(revocation_key(run_id), forged.dict(), get_dht_time() + 60,
                               subkey=forger.local_public_key)
            deadline = time.monotonic() + REFUSED_WITHIN
            while not all(w.applied is not None for w in watchers) or len(ignored()) < 2:
                assert time.monotonic() < deadline, "the watchers never read the coordinator's list and carol's"
                time.sleep(0.2)
            time.sleep(2.0)  # four more reads each
        assert [w.applied.holders for w in watchers] == [[], []]  # the coordinator's list: empty
        assert ignored() == 2 * [
            f"Ignoring a revocation list under {revocation_key(run_id)} signed by"
            f" {signer_peer_id(forger.local_public_key)}'s key, not by the run's coordinator (further lists from that"
            f" key are ignored silently)"]
        forged_warnings = len(ignored())
        assert _answers(alice, bob.peer_id) and _answers(bob, alice.peer_id) and _answers(bob, coordinator_id)
        # A list that does not parse is refused by every honest node, with a warning, and stops no watcher.
        carol.store(revocation_key(run_id), dict(run_id=run_id, holders=["bob"], time=get_dht_time() + 10**6),
                    get_dht_time() + 60, subkey=forger.local_public_key)

        code, out, _ = _run_cli(capsys, "revoke-token", "alice", "--authority-key", key)
        assert code == 0 and len(out) == 1
        revoked_at, deadline = time.monotonic(), time.monotonic() + REFUSED_WITHIN
        while _answers(alice, coordinator_id) or _answers(alice, bob.peer_id) or _answers(bob, alice.peer_id):
            assert time.monotonic() < deadline, "alice is still answered"
            time.sleep(0.2)
        refused_after = time.monotonic() - revoked_at
        print(f"alice refused {refused_after:.1f} s after revoke-token")
        assert _answers(bob, coordinator_id) and _answers(carol, bob.peer_id) and _answers(bob, carol.peer_id)
        assert [w.applied.holders for w in watchers][1] == [holder_fingerprint(grants["alice"].holder)]
        coordinator.wait_for(r"^Revoked tokens: 1 \(alice\), from .*authority\.revoked\.json$", timeout=10)

        # A file the owner broke keeps the list read before.
        revocation_path(tmp_path / "authority.key").write_text("{broken")
        coordinator.wait_for(r"is not a revocation list .*; the 1 revocation\(s\) read before stand", timeout=10)
        time.sleep(1.0)
        assert not _answers(alice, coordinator_id) and _answers(bob, coordinator_id)
        takeover_rows.add(5, "a token holder publishes, under its own key, a revocation list revoking another; then"
                             " the run's owner revokes that holder with `revoke-token`",
                          f"the forged list was ignored ({forged_warnings} warnings, one per watcher) and the other"
                          f" still answered; the revoked holder was refused by the coordinator and the peers"
                          f" {refused_after:.1f} s after `revoke-token`, the others went on")
    finally:
        for watcher in watchers:
            watcher.stop()
