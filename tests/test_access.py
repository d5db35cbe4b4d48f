"""Private runs: tokens the coordinator signs, and a swarm that answers nobody else."""

import asyncio
import time

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2, dht_pb2
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.crypto import RSAPrivateKey

from conftest import assert_clean_error, start_coordinator
from hivetrain.access import AccessGrant, RunAuthorizer, issue_grant, load_key, parse_lifetime
from hivetrain.membership import MEMBER_CACHE_SECONDS, publish_membership
from hivetrain.metrics_store import MetricsReader
from hivetrain.roles.coordinator.start import main as coordinator_main
from test_baselines import free_port


def _token_of(grant: AccessGrant, public_key: bytes | None = None) -> AccessToken:
    return AccessToken(username=grant.name, public_key=grant.holder if public_key is None else public_key,
                       expiration_time=str(grant.expires), signature=grant.signature)


def test_grants_round_trip_and_only_the_authority_signs_them(tmp_path):
    authority = load_key(tmp_path / "authority.key")
    assert load_key(tmp_path / "authority.key").to_bytes() == authority.to_bytes()  # kept, not regenerated
    assert (tmp_path / "authority.key").stat().st_mode & 0o777 == 0o600
    grant = issue_grant(authority, "alice", parse_lifetime("7d"))
    assert AccessGrant.decode(grant.encode()) == grant
    assert abs(grant.expires - (time.time() + 7 * 86400)) < 60
    coordinator = RunAuthorizer(issue_grant(authority, "coordinator", 3600))
    assert coordinator.is_token_valid(_token_of(grant))

    forged = AccessGrant(name="mallory", expires=grant.expires, authority=grant.authority, holder=grant.holder,
                         signature=grant.signature)
    expired = issue_grant(authority, "bob", -60)
    foreign = issue_grant(load_key(tmp_path / "other.key"), "eve", 3600)
    for token in (forged, expired, foreign):
        assert not coordinator.is_token_valid(_token_of(token)), token.name


def test_a_grant_seen_in_the_traffic_is_worthless_to_whoever_saw_it(tmp_path, takeover_rows):
    """Finding 5: every DHT request and answer carries its sender's grant. A volunteer whose token runs out in two
    minutes keeps the coordinator's grant (a day, renewed) from an answer, and presents it, with its own key or with
    the coordinator's public key and its own signature: both are refused. The coordinator renews its own grant."""
    authority = load_key(tmp_path / "authority.key")
    own_key = RSAPrivateKey()
    coordinator = RunAuthorizer(issue_grant(authority, "coordinator", 3600, holder=own_key, with_key=False),
                                holder=own_key, renew_with=authority)
    seen = asyncio.run(coordinator.get_token())  # what the coordinator's answers carry
    assert coordinator.is_token_valid(seen)

    mallory = RunAuthorizer(issue_grant(authority, "mallory", 120))
    assert coordinator.is_token_valid(asyncio.run(mallory.get_token()))
    relabelled = AccessToken(username=seen.username, public_key=mallory.local_public_key.to_bytes(),
                             expiration_time=seen.expiration_time, signature=seen.signature)
    assert not coordinator.is_token_valid(relabelled)

    class Replaying(RunAuthorizer):
        async def get_token(self) -> AccessToken:
            return seen  # the coordinator's grant as it was seen, the coordinator's public key in it

    replayer = Replaying(issue_grant(authority, "mallory", 120))
    request = dht_pb2.PingRequest(peer=dht_pb2.NodeInfo(node_id=b"mallory"))
    asyncio.run(replayer.sign_request(request, coordinator.local_public_key))
    assert not asyncio.run(coordinator.validate_request(request))  # signed by mallory's key, not the grant's
    honest = dht_pb2.PingRequest(peer=dht_pb2.NodeInfo(node_id=b"mallory"))
    asyncio.run(mallory.sign_request(honest, coordinator.local_public_key))
    assert asyncio.run(coordinator.validate_request(honest))

    # A grant near its end is renewed by the coordinator, for its own key; a volunteer's never is.
    coordinator.grant = issue_grant(authority, "coordinator", 60, holder=own_key, with_key=False)
    renewed = asyncio.run(coordinator.get_token())
    assert int(renewed.expiration_time) > time.time() + 86000 and renewed.public_key == seen.public_key
    assert coordinator.does_token_need_refreshing(seen) is False and not mallory.does_token_need_refreshing(seen)
    takeover_rows.add(5, "a volunteer with a two-minute grant presents the coordinator's grant seen in its answers,"
                         " relabelled with its own key or replayed as it was",
                      "both refused; its own grant accepted; the coordinator's grant is renewed for its own key only")


def test_bad_tokens_and_lifetimes_are_refused_with_a_reason():
    for text in ("", "hello", "ht2.!!!", "ht2.e30"):
        with pytest.raises(ValueError, match="not a HiveTrain access token"):
            AccessGrant.decode(text)
    with pytest.raises(ValueError, match="issued before tokens were bound to their holder"):
        AccessGrant.decode("ht1.eyJuYW1lIjoiYWxpY2UifQ")
    assert parse_lifetime("30m") == 1800 and parse_lifetime("2w") == 14 * 86400 and parse_lifetime("90") == 90
    for text in ("0d", "7 days", "-1h"):
        with pytest.raises(ValueError, match="not a lifetime"):
            parse_lifetime(text)


def test_a_private_run_admits_token_holders_only(spawn, tmp_path):
    authority = str(tmp_path / "authority.key")
    _, addresses = start_coordinator(spawn, tmp_path, "--preset", "demo", "--require-token",
                                     "--authority-key", authority, "--refresh", "1")

    def issue(name: str, key: str, expires: str = "1h") -> str:
        process = spawn(f"issue-{name}", "coordinator/start.py", "issue-token", name, "--expires", expires,
                        "--authority-key", key)
        assert process.wait(timeout=60) == 0, process.lines
        return next(line for line in process.lines if line.startswith("ht2."))

    def join(name: str, *extra: str):
        return spawn(name, "peers/join.py", "--host", "127.0.0.1", "--initial-peers", *addresses, "--threads", "1",
                     "--stop-at-epoch", "2", *extra)

    nobody = join("nobody")
    assert_clean_error(nobody, nobody.wait(timeout=120), r"refused this peer's requests.*private.*--token")
    foreign = join("foreign", "--token", issue("eve", str(tmp_path / "other.key")))
    assert_clean_error(foreign, foreign.wait(timeout=120), r"refused this peer's requests.*--token for this run")
    expired = issue_grant(load_key(tmp_path / "authority.key"), "bob", -60).encode()
    late = join("late", "--token", expired)
    assert_clean_error(late, late.wait(timeout=120), r"token \(for bob\) expired")

    alice = join("alice", "--token", issue("alice", authority))
    assert alice.wait(timeout=240) == 0, alice.log
    assert any(line.startswith("Joined run") and " as alice: " in line for line in alice.lines)  # the token's name
    time.sleep(3)  # the monitor's next look
    with MetricsReader(tmp_path / "coordinator" / "metrics.sqlite") as reader:
        assert [(row.name, row.samples) for row in reader.peers()] == [
            ("alice", int(alice.wait_for(r"contributed (\d+) samples", timeout=1).group(1)))]


def test_a_private_runs_averagers_answer_its_members_only(spawn, tmp_path, takeover_rows):
    # hivemind's averagers answer anyone who reaches the port: a host with no token downloaded a private run's model
    # straight from a volunteer. Now a volunteer's state goes to the run's members only.
    authority = str(tmp_path / "authority.key")
    coordinator, addresses = start_coordinator(spawn, tmp_path, "--preset", "demo", "--require-token",
                                               "--authority-key", authority, "--refresh", "1")
    run_id = coordinator.wait_for(r"^Run (\S+): preset", timeout=1).group(1)
    port, identity = free_port(), str(tmp_path / "alice.id")
    alice = spawn("alice", "peers/join.py", "--host", "127.0.0.1", "--port", str(port), "--identity", identity,
                  "--initial-peers", *addresses, "--threads", "1", "--client-mode", "off",
                  "--token", issue_grant(load_key(tmp_path / "authority.key"), "alice", 3600).encode())
    alice.wait_for(r"swarm epoch [1-9]\d* \|", timeout=180)  # she trained an epoch: her state averager serves her state
    alice_id = PeerID.from_identity(open(identity, "rb").read())
    address = f"/ip4/127.0.0.1/tcp/{port}/p2p/{alice_id.to_base58()}"
    prefix = f"{run_id}_state_averager"

    async def download(p2p: P2P) -> int:
        """The messages of alice's answer to a state download: none when she refuses."""
        stub = TrainingStateAverager.get_stub(p2p, alice_id, namespace=prefix)
        return len([message async for message in await stub.rpc_download_state(averaging_pb2.DownloadRequest())])

    async def as_outsider() -> int:
        p2p = await P2P.create(initial_peers=[address])
        try:
            return await download(p2p)
        finally:
            await p2p.shutdown()

    assert asyncio.run(as_outsider()) == 0
    outsider_line = alice.wait_for(r"Refusing averaging requests from (\S+): no member record", timeout=30)
    # A member asks the same: a host that holds a grant of the run and published its member record
    grant = issue_grant(load_key(tmp_path / "authority.key"), "bob", 3600)
    member = RunAuthorizer(grant)
    dht = hivemind.DHT(initial_peers=addresses, client_mode=True, authorizer=member, start=True,
                       record_validators=[RSASignatureValidator()])  # its record signed, as a peer's
    try:
        assert publish_membership(dht, run_id, member)
        admitted_by = time.monotonic()  # alice admits him at his first request, after this

        async def as_member_until_refused(deadline: float) -> tuple[int, float]:
            """His first download's messages, and when a download was first refused (the deadline: never)."""
            p2p = await dht.replicate_p2p()
            first = await download(p2p)
            assert coordinator_main(["revoke-token", grant.encode(), "--authority-key", authority]) == 0
            while time.monotonic() < deadline:
                if await download(p2p) == 0:
                    return first, time.monotonic()
                await asyncio.sleep(0.5)
            return first, deadline

        # Then the run's owner revokes his grant. alice admitted him for MEMBER_CACHE_SECONDS after his record was
        # read; the revocation list reaching her makes her averagers check him again, and refuse him, before that.
        first, refused_at = asyncio.run(as_member_until_refused(admitted_by + MEMBER_CACHE_SECONDS))
        assert first > 0  # the metadata and every tensor's parts
        assert refused_at < admitted_by + MEMBER_CACHE_SECONDS, "a revoked member was answered till his admission ended"
    finally:
        dht.shutdown()
    # the outsider's requests were refused with one line, not one per request
    refusals = len([line for line in alice.lines if outsider_line.group(1) in line and "Refusing" in line])
    assert refusals == 1
    takeover_rows.add(5, "a host with no token asks a private run's volunteer for its state (rpc_download_state)",
                      f"refused: 0 messages, {refusals} warning line; a member with a grant got the state, and was"
                      f" refused {refused_at - admitted_by:.0f} s after his first request once the owner revoked it")
