"""Private runs: the coordinator signs access tokens, and every DHT request and answer in the run carries one.

A token names a volunteer and an expiry, signed with the run's authority key (an RSA key the coordinator keeps). It
is a bearer token: whoever holds it may join until it expires. Each peer puts it in hivemind's authorizer, which signs
every DHT request and answer with the peer's own key and checks the other side's token against the authority named in
its own. A peer without a valid token gets no answers: it cannot bootstrap, read the run's configuration, find the
averaging groups or write any of the run's keys.
"""

from __future__ import annotations

import base64
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from hivetrain.hivemind_internals import rsa_key_from_der

from hivetrain.files import atomic_write

TOKEN_PREFIX = "ht1."
TOKEN_ENV = "HIVETRAIN_TOKEN"
LIFETIME_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def _payload(name: str, expires: int) -> bytes:
    return f"hivetrain-access\n{name}\n{expires}".encode()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True)
class AccessGrant:
    name: str
    expires: int  # unix time
    authority: bytes  # the run's public authority key (RSAPublicKey.to_bytes)
    signature: bytes  # the authority's signature of (name, expires)

    def encode(self) -> str:
        # both are ASCII already: an OpenSSH public key and a base64 signature
        body = dict(name=self.name, expires=self.expires, authority=self.authority.decode(),
                    signature=self.signature.decode())
        return TOKEN_PREFIX + _b64(json.dumps(body, separators=(",", ":")).encode())

    @classmethod
    def decode(cls, token: str) -> "AccessGrant":
        try:
            if not token.startswith(TOKEN_PREFIX):
                raise ValueError
            body = json.loads(_unb64(token[len(TOKEN_PREFIX):]))
            return cls(name=str(body["name"]), expires=int(body["expires"]), authority=body["authority"].encode(),
                       signature=body["signature"].encode())
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError("this is not a HiveTrain access token (they start with"
                             f" {TOKEN_PREFIX!r}; the coordinator prints them with issue-token)") from None

    @property
    def expired(self) -> bool:
        return self.expires <= time.time()


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


def issue_grant(authority: RSAPrivateKey, name: str, lifetime: int) -> AccessGrant:
    if not name or "\n" in name:
        raise ValueError("a token needs a name (one line): the volunteer it is for")
    expires = int(time.time()) + lifetime
    return AccessGrant(name=name, expires=expires, authority=authority.get_public_key().to_bytes(),
                       signature=authority.sign(_payload(name, expires)))


class RunAuthorizer(TokenAuthorizerBase):
    """hivemind's token protocol with our grants: the access token carries this peer's public key (its requests are
    signed with it) and the authority's signature of the grant; a token counts when the authority of this peer's own
    grant signed it and it has not expired."""

    def __init__(self, grant: AccessGrant, local_private_key: RSAPrivateKey | None = None):
        super().__init__(local_private_key)
        self.grant = grant
        self.authority = RSAPublicKey.from_bytes(grant.authority)

    async def get_token(self) -> AccessToken:
        return AccessToken(username=self.grant.name, public_key=self.local_public_key.to_bytes(),
                           expiration_time=str(self.grant.expires), signature=self.grant.signature)

    def is_token_valid(self, access_token: AccessToken) -> bool:
        try:
            expires = int(access_token.expiration_time)
        except ValueError:
            return False
        return expires > time.time() and self.authority.verify(_payload(access_token.username, expires),
                                                               access_token.signature)

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        return False  # a grant cannot be renewed by the peer: a new one comes from the coordinator
