"""Private runs: the coordinator signs access grants, and every DHT request and answer in the run carries one.

A grant names a volunteer, an expiry and the public key of its holder, signed with the run's authority key (an RSA
key the coordinator keeps). Each peer puts it in hivemind's authorizer, which signs every DHT request and answer with
the holder's key and checks the other side's grant against the authority named in its own: a grant counts only in the
hands of the key it names. So a grant seen in the traffic (every request carries one) is worthless to whoever saw it.

A volunteer's token carries its grant and the holder's private key, made for it by issue-token: the token is still a
secret (whoever holds it may join until it expires, unless the run's owner revokes it: hivetrain.revocation), but
the swarm never sees it. The coordinator's own grant names its own key, lives a day and is renewed as it runs out.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from hivetrain.files import atomic_write
from hivetrain.hivemind_internals import rsa_key_from_der

TOKEN_PREFIX = "ht2."
OLD_TOKEN_PREFIXES = ("ht1.",)  # bearer grants that named no holder: no longer accepted
TOKEN_ENV = "HIVETRAIN_TOKEN"
LIFETIME_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
OWN_GRANT_LIFETIME = 86400  # seconds the coordinator's own grant lives; renewed RENEW_BEFORE ahead of its expiry
RENEW_BEFORE = 3600
# Bytes of a holder fingerprint: 96 bits, so no two of a run's holder keys share one by chance, and a full revocation
# list (hivetrain.revocation.MAX_REVOKED of them) fits in one DHT record.
FINGERPRINT_BYTES = 12


def _payload(name: str, expires: int, holder: bytes) -> bytes:
    return b"hivetrain-access-2\n" + f"{name}\n{expires}\n".encode() + holder


def _peer_payload(purpose: str, peer_id: bytes) -> bytes:
    return b"hivetrain-peer-1\n" + purpose.encode() + b"\n" + peer_id


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True)
class AccessGrant:
    name: str
    expires: int  # unix time
    authority: bytes  # the run's public authority key (RSAPublicKey.to_bytes)
    holder: bytes  # the public key that alone may present this grant (RSAPublicKey.to_bytes)
    signature: bytes  # the authority's signature of (name, expires, holder)
    holder_key: Optional[bytes] = None  # the holder's private key (DER), in a volunteer's token only

    def encode(self) -> str:
        """The volunteer's token: the grant and its holder's private key (the holder's public key follows from it)."""
        if self.holder_key is None:
            raise ValueError("a grant without its holder's key makes no token")
        body = dict(name=self.name, expires=self.expires, authority=self.authority.decode(),
                    signature=self.signature.decode(), key=_b64(self.holder_key))
        return TOKEN_PREFIX + _b64(json.dumps(body, separators=(",", ":")).encode())

    @classmethod
    def decode(cls, token: str) -> "AccessGrant":
        if token.startswith(OLD_TOKEN_PREFIXES):
            raise ValueError("this token was issued before tokens were bound to their holder: ask the coordinator"
                             " for a new one (issue-token)")
        try:
            if not token.startswith(TOKEN_PREFIX):
                raise ValueError
            body = json.loads(_unb64(token[len(TOKEN_PREFIX):]))
            holder_key = _unb64(body["key"])
            holder = rsa_key_from_der(holder_key).get_public_key().to_bytes()
            return cls(name=str(body["name"]), expires=int(body["expires"]), authority=body["authority"].encode(),
                       holder=holder, signature=body["signature"].encode(), holder_key=holder_key)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError("this is not a HiveTrain access token (they start with"
                             f" {TOKEN_PREFIX!r}; the coordinator prints them with issue-token)") from None

    @property
    def expired(self) -> bool:
        return self.expires <= time.time()


def holder_fingerprint(holder: bytes) -> bytes:
    """What names a grant in a revocation: the start of the SHA-256 of the public key it names (its `holder`).

    The holder key, not the name (names repeat, and any grant can carry any), nor the token (only its holder sees it):
    issue-token makes a fresh key per token, so the key names exactly one grant, and every request in the swarm shows
    it (AccessToken.public_key), so any peer can check it against the list without seeing the token."""
    return hashlib.sha256(holder).digest()[:FINGERPRINT_BYTES]


def parse_lifetime(text: str) -> int:
    """'7d', '12h', '30m', '3600s' or plain seconds -> seconds."""
    match = re.fullmatch(r"(\d+)([smhdw]?)", text.strip())
    if not match or int(match.group(1)) == 0:
        raise ValueError(f"{text!r} is not a lifetime: use e.g. 30m, 12h, 7d or 2w")
    return int(match.group(1)) * LIFETIME_UNITS[match.group(2) or "s"]


def load_key(path: Path, what: str = "authority key") -> RSAPrivateKey:
    """The RSA key kept in `path` (the run's authority key); created (readable by its owner only) when the file does
    not exist yet."""
    if path.exists():
        try:
            return rsa_key_from_der(path.read_bytes())
        except ValueError:
            raise ValueError(f"{path} is not an {what} (DER-encoded RSA private key)") from None
    key = RSAPrivateKey()
    atomic_write(path, key.to_bytes(), mode=0o600)
    return key


def issue_grant(authority: RSAPrivateKey, name: str, lifetime: int, holder: Optional[RSAPrivateKey] = None,
                with_key: bool = True) -> AccessGrant:
    """A grant for `name`, valid `lifetime` seconds, that only `holder` may present (a new key when None).

    Args:
        authority: the run's authority key, which signs the grant.
        name: the volunteer it is for (its display name in the swarm).
        lifetime: seconds until it expires.
        holder: the key the grant names; a volunteer's is made here, the coordinator names its own.
        with_key: carry the holder's private key, so that the grant encodes as a volunteer's token.
    """
    if not name or "\n" in name:
        raise ValueError("a token needs a name (one line): the volunteer it is for")
    holder = holder or RSAPrivateKey()
    public = holder.get_public_key().to_bytes()
    expires = int(time.time()) + lifetime
    return AccessGrant(name=name, expires=expires, authority=authority.get_public_key().to_bytes(), holder=public,
                       signature=authority.sign(_payload(name, expires, public)),
                       holder_key=holder.to_bytes() if with_key else None)


class RunAuthorizer(TokenAuthorizerBase):
    """hivemind's token protocol with our grants: this peer's access token carries its grant and the public key it
    names, and hivemind signs each request and answer with that key's private part (so only the holder can present
    the grant). A token counts when the authority of this peer's own grant signed it, for the key that presents it,
    it has not expired, and the run's owner has not revoked it (its holder key's fingerprint is not in `revoked`).

    hivemind runs the authorizer in the DHT's own process: a revocation list reaches it there
    (hivetrain.revocation.apply_revocations), not through this process's copy.

    Args:
        grant: this peer's grant; a volunteer's carries its holder key, with which this peer signs.
        holder: the key the grant names, when the grant does not carry it (the coordinator's own key).
        renew_with: the authority key, for the coordinator: its own grant is renewed before it expires.
        revoked: the holder fingerprints (holder_fingerprint) of the grants the run's owner revoked.
    """

    def __init__(self, grant: AccessGrant, holder: Optional[RSAPrivateKey] = None,
                 renew_with: Optional[RSAPrivateKey] = None, revoked: Iterable[bytes] = ()):
        holder = holder or (rsa_key_from_der(grant.holder_key) if grant.holder_key else None)
        if holder is None or holder.get_public_key().to_bytes() != grant.holder:
            raise ValueError(f"the grant for {grant.name} names another key than the one given to present it")
        super().__init__(holder)
        self.grant, self.holder, self.renew_with = grant, holder, renew_with
        self.authority = RSAPublicKey.from_bytes(grant.authority)
        self.revoked: frozenset[bytes] = frozenset()
        self.set_revoked(revoked)

    def set_revoked(self, fingerprints: Iterable[bytes]) -> None:
        """Refuse from now on the grants whose holder fingerprints are `fingerprints` (the whole list: it replaces the
        one before). Never this peer's own: hivemind asserts that its own token is valid whenever it renews it."""
        self.revoked = frozenset(fingerprints) - {holder_fingerprint(self.grant.holder)}

    async def get_token(self) -> AccessToken:
        if self.renew_with is not None and self.grant.expires - time.time() < RENEW_BEFORE:
            self.grant = issue_grant(self.renew_with, self.grant.name, OWN_GRANT_LIFETIME, self.holder,
                                     with_key=False)
        return AccessToken(username=self.grant.name, public_key=self.grant.holder,
                           expiration_time=str(self.grant.expires), signature=self.grant.signature)

    def is_token_valid(self, access_token: AccessToken) -> bool:
        try:
            expires = int(access_token.expiration_time)
        except ValueError:
            return False
        return (expires > time.time() and holder_fingerprint(access_token.public_key) not in self.revoked
                and self.authority.verify(_payload(access_token.username, expires, access_token.public_key),
                                          access_token.signature))

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        # The coordinator renews its own grant; a volunteer's new grant comes from the coordinator, in a new token.
        return self.renew_with is not None and int(access_token.expiration_time) - time.time() < RENEW_BEFORE

    def peer_proof(self, purpose: str, peer_id: bytes) -> dict:
        """What shows that the libp2p peer `peer_id` acts for this grant's holder: the grant's fields and the holder's
        signature of `purpose` and the peer ID. libp2p authenticates peer IDs, so a proof seen in the traffic is
        worthless to any other peer.

        Args:
            purpose: what the proof is for (the run whose averagers the peer may call; a dial-back check): a proof
                for one does not pass for another.
            peer_id: the libp2p peer ID (PeerID.to_bytes()) that presents it.
        """
        return dict(name=self.grant.name, holder=self.grant.holder, expires=self.grant.expires,
                    grant_signature=self.grant.signature, proof=self.holder.sign(_peer_payload(purpose, peer_id)))

    def is_peer_proof_valid(self, purpose: str, peer_id: bytes, proof: dict) -> bool:
        """Whether `proof` (peer_proof's fields) shows that `peer_id` acts for a valid grant of this run: signed by
        this peer's authority, unexpired, not revoked, and its holder signed `purpose` and `peer_id`."""
        try:
            token = AccessToken(username=proof["name"], public_key=proof["holder"],
                                expiration_time=str(int(proof["expires"])), signature=proof["grant_signature"])
            return self.is_token_valid(token) and RSAPublicKey.from_bytes(proof["holder"]).verify(
                _peer_payload(purpose, peer_id), proof["proof"])
        except Exception:  # a field of the wrong type, a key that does not load: no proof
            return False
