"""Signed keys for fleets: bearer tokens that are JWTs signed by the operator, no store needed.

A replica started with `--jwt-public-key FILE` accepts, besides the keys of its store
(`zh-...`), any bearer token that is a JWT signed with the operator's private key. The token
itself carries who the caller is and what it may do, so every replica of a fleet admits it
with no shared database and no network call: verification is local (PyJWT + cryptography).
This module is the verifier; the key files and signing are `zerohop.gateway.keys.operator_keys`,
the claims and the `Identity` they map to `zerohop.gateway.keys.signed_claims`, the revoked file
`zerohop.gateway.keys.revocation`, and `zerohop keys sign` / `keygen`
`zerohop.cli.keys_signed`.

Algorithms
    Each public key verifies exactly one algorithm (EdDSA for Ed25519, ES256 for P-256), and
    PyJWT is given only that one (`algorithms=[alg]`). Any other `alg` (`none`, HS256,
    RS256, ...) is refused before a key is touched, so HS256 "signed" with the public key
    (algorithm confusion) cannot pass. A token whose header names a `kid` is checked against
    the JWKS keys with that `kid`; without one (or with PEM keys, which have no kid) each key
    of its algorithm is tried.

Time
    `exp` and `nbf` are checked with a leeway of 5 s (DEFAULT_LEEWAY; constructor argument)
    for clock skew between the machine that signed and the replica: a token is refused
    once now >= exp + leeway, and while now < nbf - leeway. A token without `exp` would
    never expire: it is refused unless the verifier is made with `allow_nonexpiring=True`
    (`zerohop serve --allow-nonexpiring-signed-keys`), when only revocation ends it.

Cache
    Verified tokens are cached by their exact string (an LRU of up to 10,000 tokens): a
    client that sends the same token a thousand times a second costs one signature check.
    A cache hit still checks expiry, not-before and revocation, never the signature.
    Tokens refused for a reason that cannot change (bad signature, alg, audience, claims,
    expired) are remembered too (1,024 of them), so a client retrying a bad token costs no
    signature check either. `signature_checks` counts the signature verifications made.

Revocation
    `--revoked FILE`: one key id (`sub`) or token id (`jti`) per line, checked on every
    `verify` (cache hits included); the file is stat()ed at most once per second and re-read
    when it changed (`zerohop.gateway.keys.revocation`).

Audit
    A token refused after its signature verified (expired, not yet valid, revoked, without
    expiry, for another audience, with refused claims) carries the `KeyRef` its `sub` and
    `tenant` name, so the audit record names the key; before that (a bad signature, alg or
    shape) the caller stays anonymous: an unverified token's claims are anyone's words.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jwt

from zerohop.gateway.keys.identity import Identity, KeyRef
from zerohop.gateway.keys.operator_keys import (
    ALGORITHMS,
    DEFAULT_AUDIENCE,
    PublicKey,
    load_public_keys,
)
from zerohop.gateway.keys.revocation import REVOKED_CHECK_INTERVAL, RevokedFile
from zerohop.gateway.keys.signed_claims import identity_from_claims, iso_time, numeric_date

DEFAULT_LEEWAY = 5.0  # seconds, for exp and nbf
MAX_TOKEN_LENGTH = 16384
DEFAULT_CACHE_SIZE = 10_000
REJECTED_CACHE_SIZE = 1_024

_JWT_SHAPE = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*")
# Decoding checks the signature and the audience; times are checked by the verifier itself
# (the same code for a cache hit and a miss, against the verifier's clock).
_DECODE_OPTIONS: Any = {"verify_exp": False, "verify_nbf": False, "verify_iat": False}
_NONE_REVOKED: frozenset[str] = frozenset()


class AuthenticationError(Exception):
    """A bearer token was refused; the message says why (safe to show to the client).
    `key`: the key it names, once its signature verified (for the audit), else None."""

    def __init__(self, message: str, key: KeyRef | None = None) -> None:
        super().__init__(message)
        self.key = key


def looks_like_jwt(token: str) -> bool:
    """Three dot-separated segments, the first a base64url JSON object with "alg" (~0.3 us:
    the headers of one signer's tokens are all alike, and their answers are cached)."""
    if token.count(".") != 2:
        return False
    return _header_has_alg(token[: token.index(".")])


_B64URL = re.compile(r"[A-Za-z0-9_-]+")


@functools.lru_cache(maxsize=1024)
def _header_has_alg(head: str) -> bool:
    if len(head) > 1024 or not _B64URL.fullmatch(head):
        return False
    try:
        header = json.loads(base64.urlsafe_b64decode(head + "=" * (-len(head) % 4)))
    except (ValueError, binascii.Error):
        return False
    return isinstance(header, dict) and "alg" in header


# ---------------------------------------------------------------------------------------
# Verifier


class _Entry:
    """A token whose signature and claims were verified once."""

    __slots__ = ("exp", "identity", "jti", "nbf")

    def __init__(self, identity: Identity, exp: float | None, nbf: float | None) -> None:
        self.identity, self.exp, self.nbf = identity, exp, nbf
        self.jti = identity.extra.get("jti")


class _Permanent(AuthenticationError):
    """A refusal that stays true: remembered, so retrying costs no signature check."""


class SignedKeyVerifier:
    """Verifies signed keys against the operator's public key(s); `verify` -> Identity.

    Not thread-safe beyond what the GIL gives (cache updates tolerate races); meant to be
    called from the server's event loop.
    """

    def __init__(
        self,
        public_key_file: str | os.PathLike[str],
        *,
        audience: str = DEFAULT_AUDIENCE,
        revoked_file: str | os.PathLike[str] | None = None,
        leeway: float = DEFAULT_LEEWAY,
        cache_size: int = DEFAULT_CACHE_SIZE,
        revoked_check_interval: float = REVOKED_CHECK_INTERVAL,
        clock: Callable[[], float] = time.time,
        allow_nonexpiring: bool = False,
    ) -> None:
        path = Path(public_key_file)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ValueError(f"cannot read public key file {path}: {e.strerror}") from None
        self.keys = load_public_keys(data, str(path))
        self.algorithms = frozenset(k.alg for k in self.keys)
        self._by_kid: dict[str, list[PublicKey]] = {}
        for k in self.keys:
            if k.kid is not None:
                self._by_kid.setdefault(k.kid, []).append(k)
        if not audience:
            raise ValueError("the audience must not be empty")
        self.audience = audience
        self.leeway = float(leeway)
        self.allow_nonexpiring = allow_nonexpiring
        self.cache_size = max(1, int(cache_size))
        self._clock = clock
        self.signature_checks = 0  # signature verifications made (cache misses, per key)
        self._cache: OrderedDict[str, _Entry] = OrderedDict()
        self._rejected: OrderedDict[str, tuple[str, KeyRef | None]] = OrderedDict()
        self._revoked = (
            None
            if revoked_file is None
            else RevokedFile(revoked_file, check_interval=revoked_check_interval, clock=clock)
        )

    @property
    def revoked(self) -> frozenset[str]:
        """The key ids and token ids of the revoked file, as last read."""
        return _NONE_REVOKED if self._revoked is None else self._revoked.ids

    def reload_revoked(self) -> None:
        """Re-read the revoked file now if it changed (verify does this once a second)."""
        if self._revoked is not None:
            self._revoked.reload()

    # -- verification --------------------------------------------------------------------

    def verify(self, token: str) -> Identity:
        """The Identity a signed key stands for; AuthenticationError says why not."""
        now = self._clock()
        revoked_file = self._revoked
        if revoked_file is not None and now >= revoked_file.next_check:
            revoked_file.reload()
        entry = self._cache.get(token)
        if entry is None:
            entry = self._verify_uncached(token)
        else:
            try:  # noqa: SIM105 (contextlib.suppress costs more, on the hot path)
                self._cache.move_to_end(token)
            except KeyError:  # evicted meanwhile (another thread)
                pass
        identity = entry.identity
        if entry.exp is not None and now >= entry.exp + self.leeway:
            self._cache.pop(token, None)
            message = f"token for key {identity.key_id!r} expired at {iso_time(entry.exp)}"
            self._remember_rejection(token, message, identity.ref())
            raise AuthenticationError(message, identity.ref())
        if entry.nbf is not None and now < entry.nbf - self.leeway:
            raise AuthenticationError(
                f"token for key {identity.key_id!r} is not valid before {iso_time(entry.nbf)}",
                identity.ref(),
            )
        revoked = _NONE_REVOKED if revoked_file is None else revoked_file.ids
        if revoked:
            if identity.key_id in revoked:
                raise AuthenticationError(f"key {identity.key_id!r} is revoked", identity.ref())
            if entry.jti is not None and entry.jti in revoked:
                raise AuthenticationError(
                    f"token {entry.jti!r} of key {identity.key_id!r} is revoked", identity.ref()
                )
        return identity

    def cached(self, token: str) -> bool:
        """Whether `token` has been verified and is still cached (tests, metrics)."""
        return token in self._cache

    def _remember_rejection(self, token: str, message: str, key: KeyRef | None) -> None:
        rejected = self._rejected
        rejected[token] = (message, key)
        while len(rejected) > REJECTED_CACHE_SIZE:
            try:
                rejected.popitem(last=False)
            except KeyError:
                break

    def _verify_uncached(self, token: str) -> _Entry:
        rejection = self._rejected.get(token)
        if rejection is not None:
            raise AuthenticationError(*rejection)
        try:
            entry = self._decode(token)
        except _Permanent as e:
            self._remember_rejection(token, str(e), e.key)
            raise AuthenticationError(str(e), e.key) from None
        cache = self._cache
        cache[token] = entry
        while len(cache) > self.cache_size:
            try:
                cache.popitem(last=False)
            except KeyError:
                break
        return entry

    def _candidates(self, header: dict[str, Any]) -> list[PublicKey]:
        alg = header.get("alg")
        if alg not in ALGORITHMS:
            raise _Permanent(
                f"token algorithm {alg!r} is not allowed (only {' and '.join(ALGORITHMS)})"
            )
        if alg not in self.algorithms:
            raise _Permanent(
                f"token is signed with {alg}, but the configured public key(s) verify only"
                f" {', '.join(sorted(self.algorithms))}"
            )
        kid = header.get("kid")
        keys = self.keys
        if kid is not None and self._by_kid:
            if not isinstance(kid, str) or kid not in self._by_kid:
                raise _Permanent(f"no configured public key has the token's kid {kid!r}")
            keys = self._by_kid[kid]
        keys = [k for k in keys if k.alg == alg]
        if not keys:
            raise _Permanent(f"the public key with kid {kid!r} does not verify {alg}")
        return keys

    def _decode(self, token: str) -> _Entry:
        if not isinstance(token, str):
            raise AuthenticationError(f"token must be a string, not {type(token).__name__}")
        if not token:
            raise _Permanent("empty token")
        if len(token) > MAX_TOKEN_LENGTH:
            raise _Permanent(f"token is longer than {MAX_TOKEN_LENGTH} characters")
        if not _JWT_SHAPE.fullmatch(token):
            raise _Permanent("malformed token: not a JWT (three base64url segments)")
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError as e:
            raise _Permanent(f"malformed token header: {e}") from None
        payload = None
        for key in self._candidates(header):
            self.signature_checks += 1
            try:
                payload = jwt.decode(
                    token,
                    key=key.key,
                    algorithms=[key.alg],
                    audience=self.audience,
                    options=_DECODE_OPTIONS,
                )
                break
            except jwt.InvalidSignatureError:
                continue
            # PyJWT checks the claims only once the signature verified: these name the key.
            except jwt.MissingRequiredClaimError as e:
                signed = _claimed_key(jwt.decode(token, options={"verify_signature": False}))
                if e.claim == "aud":
                    raise _Permanent(
                        f"token has no audience (aud); expected {self.audience!r}", signed
                    ) from None
                raise _Permanent(f"token lacks the claim {e.claim!r}", signed) from None
            except jwt.InvalidAudienceError:
                claims = jwt.decode(token, options={"verify_signature": False})
                raise _Permanent(
                    f"token is for audience {claims.get('aud')!r}, not {self.audience!r}",
                    _claimed_key(claims),
                ) from None
            except jwt.DecodeError as e:
                raise _Permanent(f"malformed token: {e}") from None
            except jwt.PyJWTError as e:
                raise _Permanent(f"invalid token: {e}") from None
        if payload is None:
            raise _Permanent("bad signature: the token is not signed by a configured key")
        try:
            identity = identity_from_claims(payload)
        except ValueError as e:
            raise _Permanent(f"invalid claims: {e}", _claimed_key(payload)) from None
        if identity.expires_at is None and not self.allow_nonexpiring:
            raise _Permanent(
                f"token for key {identity.key_id!r} has no expiry (claim 'exp'): this server"
                " accepts only signed keys that expire",
                identity.ref(),
            )
        return _Entry(identity, identity.expires_at, numeric_date(payload, "nbf"))


def _claimed_key(claims: object) -> KeyRef | None:
    """The key a token whose signature verified names (`sub`, `tenant`), though its claims are
    refused; None where `sub` is no key id."""
    if not isinstance(claims, dict):
        return None
    sub, tenant = claims.get("sub"), claims.get("tenant")
    if not isinstance(sub, str) or not sub:
        return None
    return KeyRef(sub, tenant if isinstance(tenant, str) and tenant else None)
