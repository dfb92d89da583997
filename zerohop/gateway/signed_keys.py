"""Signed keys for fleets: bearer tokens that are JWTs signed by the operator, no store needed.

A replica started with `--jwt-public-key FILE` accepts, besides the keys of its store
(`zh-...`), any bearer token that is a JWT signed with the operator's private key. The token
itself carries who the caller is and what it may do, so every replica of a fleet admits it
with no shared database and no network call: verification is local (PyJWT + cryptography).

Keys and algorithms
    The public key file is PEM (one or more `PUBLIC KEY` blocks, Ed25519 or EC P-256) or a
    JWKS JSON file (`{"keys": [...]}` or a single JWK) with OKP/Ed25519 and EC/P-256 keys;
    other JWKs in the set (RSA, other curves, `use: enc`) are skipped. Each key verifies
    exactly one algorithm: EdDSA for Ed25519, ES256 for P-256, and PyJWT is given only that
    one (`algorithms=[alg]`). Any other `alg` (`none`, HS256, RS256, ...) is refused before
    a key is touched, so HS256 "signed" with the public key (algorithm confusion) cannot
    pass. A token whose header names a `kid` is checked against the JWKS keys with that
    `kid`; without one (or with PEM keys, which have no kid) each key of its algorithm is
    tried.

Claims (the JWT carries no `kid` claim: the key id is `sub`)
    sub            str, required     the key id (public: logs, audit, revocation)
    tenant         str, required     the tenant's name
    name           str               a label for the key ("")
    models         [str]             allowed models ([]: every model)
    priority       str               "interactive" (default) or "batch"
    limits         {rpm, itpm, otpm, max_concurrency}: ints >= 0, each optional
    budget         {tokens: int >= 0, period: "day" | "month" | "total" (default)}
    tenant_limits  like limits, for the whole tenant
    tenant_budget  like budget, for the whole tenant
    tenant_weight  number > 0, the tenant's fair-share weight (1.0)
    aud            str or [str], required: must contain the verifier's audience
                   ("zerohop" unless configured)
    exp            NumericDate: expiry (optional; without it only revocation ends the key)
    nbf            NumericDate: not valid before (optional)
    iat            NumericDate: issued at (informational; `zerohop keys sign` sets it)
    jti            str: the token's own id (`zerohop keys sign` sets a random one)
    Unknown top-level claims are ignored; unknown fields inside limits and budgets are
    refused (a typo such as "rmp" must not silently mean "unlimited"). Claims map to an
    `Identity` with source="jwt", its `Tenant` built from the tenant claims, expires_at=exp
    and extra={"jti": ..., "iat": ...}.

Time
    `exp` and `nbf` are checked with a leeway of 5 s (DEFAULT_LEEWAY; constructor argument)
    for clock skew between the machine that signed and the replica: a token is refused
    once now >= exp + leeway, and while now < nbf - leeway.

Cache
    Verified tokens are cached by their exact string (an LRU of up to 10,000 tokens): a
    client that sends the same token a thousand times a second costs one signature check.
    A cache hit still checks expiry, not-before and revocation, never the signature.
    Tokens refused for a reason that cannot change (bad signature, alg, audience, claims,
    expired) are remembered too (1,024 of them), so a client retrying a bad token costs no
    signature check either. `signature_checks` counts the signature verifications made.

Revocation
    `--revoked FILE`: one key id (`sub`) or token id (`jti`) per line; blank lines and
    `#` comments are ignored. The file is stat()ed at most once per second (from `verify`,
    a few microseconds) and re-read only when its mtime, size or inode changed; a file
    that disappears or cannot be read keeps the previous list (and is logged).
"""

from __future__ import annotations

import argparse
import base64
import binascii
import functools
import json
import logging
import os
import re
import sys
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from zerohop.gateway.identity import (
    BUDGET_PERIODS,
    PRIORITY_CLASSES,
    Budget,
    Identity,
    Limits,
    Tenant,
)

log = logging.getLogger(__name__)

DEFAULT_AUDIENCE = "zerohop"
DEFAULT_LEEWAY = 5.0  # seconds, for exp and nbf
ALGORITHMS = ("EdDSA", "ES256")
MAX_TOKEN_LENGTH = 16384
DEFAULT_CACHE_SIZE = 10_000
REJECTED_CACHE_SIZE = 1_024
REVOKED_CHECK_INTERVAL = 1.0  # seconds between two stat()s of the revoked file

_LIMIT_FIELDS = ("rpm", "itpm", "otpm", "max_concurrency")
_JWT_SHAPE = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*")
# Decoding checks the signature and the audience; times are checked by the verifier itself
# (the same code for a cache hit and a miss, against the verifier's clock).
_DECODE_OPTIONS: Any = {"verify_exp": False, "verify_nbf": False, "verify_iat": False}


class AuthenticationError(Exception):
    """A bearer token was refused; the message says why (safe to show to the client)."""


# ---------------------------------------------------------------------------------------
# Claims <-> Identity


def _nonneg_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where} must be an integer >= 0, not {value!r}")
    return value


def _limits_from(obj: Any, where: str) -> Limits:
    if obj is None:
        return Limits()
    if not isinstance(obj, dict):
        raise ValueError(f"claim {where!r} must be an object, not {obj!r}")
    unknown = sorted(set(obj) - set(_LIMIT_FIELDS))
    if unknown:
        raise ValueError(f"claim {where!r} has unknown fields {unknown} (known: {_LIMIT_FIELDS})")
    values = {
        k: None if obj.get(k) is None else _nonneg_int(obj[k], f"{where}.{k}")
        for k in _LIMIT_FIELDS
    }
    return Limits(**values)


def _budget_from(obj: Any, where: str) -> Budget | None:
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise ValueError(f"claim {where!r} must be an object, not {obj!r}")
    unknown = sorted(set(obj) - {"tokens", "period"})
    if unknown:
        raise ValueError(f"claim {where!r} has unknown fields {unknown} (known: tokens, period)")
    if "tokens" not in obj:
        raise ValueError(f"claim {where!r} has no 'tokens'")
    tokens = _nonneg_int(obj["tokens"], f"{where}.tokens")
    period = obj.get("period", "total")
    if period not in BUDGET_PERIODS:
        raise ValueError(f"{where}.period must be one of {BUDGET_PERIODS}, not {period!r}")
    return Budget(tokens, period)


def _numeric_date(claims: dict, name: str) -> float | None:
    value = claims.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"claim {name!r} must be a number (unix seconds), not {value!r}")
    return float(value)


def identity_from_claims(claims: dict) -> Identity:
    """The `Identity` a (verified) claims set stands for; ValueError names a bad claim."""
    sub = claims.get("sub")
    if not isinstance(sub, str) or not sub:
        raise ValueError("claim 'sub' (the key id) is missing or not a non-empty string")
    tenant = claims.get("tenant")
    if not isinstance(tenant, str) or not tenant:
        raise ValueError("claim 'tenant' is missing or not a non-empty string")
    name = claims.get("name", "")
    if not isinstance(name, str):
        raise ValueError(f"claim 'name' must be a string, not {name!r}")
    models = claims.get("models") or []
    if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
        raise ValueError(f"claim 'models' must be a list of model names, not {models!r}")
    priority = claims.get("priority", "interactive")
    if priority not in PRIORITY_CLASSES:
        raise ValueError(f"claim 'priority' must be one of {PRIORITY_CLASSES}, not {priority!r}")
    weight = claims.get("tenant_weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0:
        raise ValueError(f"claim 'tenant_weight' must be a number > 0, not {weight!r}")
    jti = claims.get("jti")
    if jti is not None and not isinstance(jti, str):
        raise ValueError(f"claim 'jti' must be a string, not {jti!r}")
    exp = _numeric_date(claims, "exp")
    _numeric_date(claims, "nbf")
    iat = _numeric_date(claims, "iat")
    extra = {k: v for k, v in (("jti", jti), ("iat", iat)) if v is not None}
    return Identity(
        key_id=sub,
        tenant=Tenant(
            name=tenant,
            limits=_limits_from(claims.get("tenant_limits"), "tenant_limits"),
            budget=_budget_from(claims.get("tenant_budget"), "tenant_budget"),
            weight=float(weight),
        ),
        name=name,
        models=tuple(models),
        priority=priority,
        limits=_limits_from(claims.get("limits"), "limits"),
        budget=_budget_from(claims.get("budget"), "budget"),
        expires_at=exp,
        source="jwt",
        extra=extra,
    )


def _limits_claim(limits: Limits) -> dict:
    return {k: getattr(limits, k) for k in _LIMIT_FIELDS if getattr(limits, k) is not None}


def claims_from_identity(identity: Identity) -> dict:
    """The claims (without aud/exp/iat/jti) that `identity_from_claims` maps back to it."""
    claims: dict[str, Any] = {"sub": identity.key_id, "tenant": identity.tenant.name}
    if identity.name:
        claims["name"] = identity.name
    if identity.models:
        claims["models"] = list(identity.models)
    if identity.priority != "interactive":
        claims["priority"] = identity.priority
    for name, limits in (("limits", identity.limits), ("tenant_limits", identity.tenant.limits)):
        if limits.any():
            claims[name] = _limits_claim(limits)
    for name, budget in (("budget", identity.budget), ("tenant_budget", identity.tenant.budget)):
        if budget is not None:
            claims[name] = {"tokens": budget.tokens, "period": budget.period}
    if identity.tenant.weight != 1.0:
        claims["tenant_weight"] = identity.tenant.weight
    if identity.expires_at is not None:
        claims["exp"] = int(identity.expires_at)
    return claims


# ---------------------------------------------------------------------------------------
# Keys


class _PublicKey:
    __slots__ = ("alg", "key", "kid")

    def __init__(self, key: Any, alg: str, kid: str | None) -> None:
        self.key, self.alg, self.kid = key, alg, kid


def _alg_of(key: Any) -> str | None:
    if isinstance(key, ed25519.Ed25519PublicKey | ed25519.Ed25519PrivateKey):
        return "EdDSA"
    if isinstance(key, ec.EllipticCurvePublicKey | ec.EllipticCurvePrivateKey) and isinstance(
        key.curve, ec.SECP256R1
    ):
        return "ES256"
    return None


def _describe(key: Any) -> str:
    curve = getattr(key, "curve", None)
    return f"EC {curve.name}" if curve is not None else type(key).__name__.lstrip("_")


_PEM_BLOCK = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----.*?-----END \1-----", re.DOTALL)


def _load_pem_keys(data: bytes, source: str) -> list[_PublicKey]:
    keys = []
    for n, m in enumerate(_PEM_BLOCK.finditer(data), 1):
        label = m.group(1).decode()
        if "PRIVATE" in label:
            raise ValueError(
                f"{source} holds a private key: give the verifier the public key"
                " (zerohop keys keygen --out-public)"
            )
        if label != "PUBLIC KEY":
            raise ValueError(f"{source}: PEM block {n} is {label!r}, expected 'PUBLIC KEY'")
        try:
            key = serialization.load_pem_public_key(m.group(0))
        except ValueError as e:
            raise ValueError(f"{source}: PEM block {n} is not a valid public key: {e}") from None
        alg = _alg_of(key)
        if alg is None:
            raise ValueError(
                f"{source}: PEM block {n} is a {_describe(key)} key;"
                " only Ed25519 and EC P-256 keys are supported"
            )
        keys.append(_PublicKey(key, alg, None))
    if not keys:
        raise ValueError(f"{source} holds no PEM 'PUBLIC KEY' block")
    return keys


def _load_jwks(data: bytes, source: str) -> list[_PublicKey]:
    try:
        obj = json.loads(data)
    except ValueError as e:
        raise ValueError(f"{source} is not valid JSON: {e}") from None
    if isinstance(obj, dict) and isinstance(obj.get("keys"), list):
        jwks = obj["keys"]
    elif isinstance(obj, dict) and "kty" in obj:
        jwks = [obj]
    else:
        raise ValueError(f"{source} is neither a JWKS ({{'keys': [...]}}) nor a JWK")
    keys, skipped = [], []
    for n, jwk in enumerate(jwks, 1):
        if not isinstance(jwk, dict):
            raise ValueError(f"{source}: key {n} is not a JSON object")
        kid = jwk.get("kid")
        if kid is not None and not isinstance(kid, str):
            raise ValueError(f"{source}: key {n} has a non-string kid {kid!r}")
        kty, crv = jwk.get("kty"), jwk.get("crv")
        if kty == "OKP" and crv == "Ed25519":
            alg, algorithm = "EdDSA", jwt.algorithms.OKPAlgorithm
        elif kty == "EC" and crv == "P-256":
            alg, algorithm = "ES256", jwt.algorithms.ECAlgorithm
        else:
            skipped.append(f"{kid or n}: {kty}/{crv}")
            continue
        if jwk.get("use", "sig") != "sig" or jwk.get("alg", alg) != alg:
            skipped.append(f"{kid or n}: use={jwk.get('use')} alg={jwk.get('alg')}")
            continue
        public = {k: v for k, v in jwk.items() if k != "d"}  # never verify with private parts
        try:
            key = algorithm.from_jwk(public)
        except (jwt.PyJWTError, ValueError, TypeError) as e:
            raise ValueError(f"{source}: key {kid or n} is not a valid {kty} key: {e}") from None
        keys.append(_PublicKey(key, alg, kid))
    if not keys:
        raise ValueError(
            f"{source} holds no Ed25519 or EC P-256 signing key (skipped: {', '.join(skipped)})"
        )
    return keys


def load_public_keys(data: bytes, source: str = "public key file") -> list[_PublicKey]:
    """Public keys from PEM or JWKS bytes; ValueError (naming `source`) if none is usable."""
    if data.lstrip()[:1] == b"{":
        return _load_jwks(data, source)
    return _load_pem_keys(data, source)


def generate_keypair(kind: str = "ed25519") -> tuple[bytes, bytes]:
    """A new (private PEM (PKCS#8, unencrypted), public PEM) pair: "ed25519" or "es256"."""
    if kind == "ed25519":
        private: Any = ed25519.Ed25519PrivateKey.generate()
    elif kind == "es256":
        private = ec.generate_private_key(ec.SECP256R1())
    else:
        raise ValueError(f"unknown key kind {kind!r} (ed25519 or es256)")
    private_pem = private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    public_pem = private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return private_pem, public_pem


def public_jwk(public_pem: bytes, kid: str | None = None) -> dict:
    """The JWK (with alg and use) of one PEM public key, for a JWKS file."""
    (key,) = _load_pem_keys(public_pem, "public key")
    if key.alg == "EdDSA":
        jwk = jwt.algorithms.OKPAlgorithm.to_jwk(key.key, as_dict=True)
    else:
        jwk = jwt.algorithms.ECAlgorithm.to_jwk(key.key, as_dict=True)
    jwk.update({"alg": key.alg, "use": "sig"})
    if kid:
        jwk["kid"] = kid
    return jwk


def _load_private_key(private_key_pem: bytes) -> tuple[Any, str]:
    try:
        key = serialization.load_pem_private_key(private_key_pem, password=None)
    except (ValueError, TypeError) as e:
        raise ValueError(f"the private key is not an unencrypted PEM key: {e}") from None
    alg = _alg_of(key)
    if alg is None:
        raise ValueError(
            f"the private key is a {_describe(key)} key; only Ed25519 and EC P-256 keys sign"
        )
    return key, alg


def sign(
    private_key_pem: bytes,
    claims: dict,
    *,
    expires_in: float | None,
    audience: str = DEFAULT_AUDIENCE,
    kid: str | None = None,
    now: float | None = None,
) -> str:
    """A signed key: EdDSA for an Ed25519 private key, ES256 for a P-256 one.

    Adds `aud` (unless `claims` has one), `iat`, a random `jti` (unless given) and, when
    `expires_in` is not None, `exp` = now + expires_in (it may be negative, for tests).
    `kid` goes in the header (to pick the key of a JWKS). The claims are checked against
    the schema first, so this never mints a token a verifier would refuse for its claims.
    """
    key, alg = _load_private_key(private_key_pem)
    now = time.time() if now is None else now
    payload = dict(claims)
    payload.setdefault("aud", audience)
    payload.setdefault("iat", int(now))
    payload.setdefault("jti", uuid.uuid4().hex)
    if expires_in is not None:
        payload["exp"] = int(now + expires_in)
    identity_from_claims(payload)
    return jwt.encode(payload, key, algorithm=alg, headers={"kid": kid} if kid else None)


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


def _iso(t: float) -> str:
    try:
        return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds")
    except (OverflowError, OSError, ValueError):
        return repr(t)


class _Permanent(AuthenticationError):
    """A refusal that stays true: remembered, so retrying costs no signature check."""


class SignedKeyVerifier:
    """Verifies signed keys against the operator's public key(s); `verify` -> Identity.

    Not thread-safe beyond what the GIL gives (cache updates tolerate races); meant to be
    called from the server's event loop.
    """

    def __init__(
        self,
        public_key_file: str | os.PathLike,
        *,
        audience: str = DEFAULT_AUDIENCE,
        revoked_file: str | os.PathLike | None = None,
        leeway: float = DEFAULT_LEEWAY,
        cache_size: int = DEFAULT_CACHE_SIZE,
        revoked_check_interval: float = REVOKED_CHECK_INTERVAL,
        clock: Callable[[], float] = time.time,
    ) -> None:
        path = Path(public_key_file)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ValueError(f"cannot read public key file {path}: {e.strerror}") from None
        self.keys = load_public_keys(data, str(path))
        self.algorithms = frozenset(k.alg for k in self.keys)
        self._by_kid: dict[str, list[_PublicKey]] = {}
        for k in self.keys:
            if k.kid is not None:
                self._by_kid.setdefault(k.kid, []).append(k)
        if not audience:
            raise ValueError("the audience must not be empty")
        self.audience = audience
        self.leeway = float(leeway)
        self.cache_size = max(1, int(cache_size))
        self.revoked_check_interval = revoked_check_interval
        self._clock = clock
        self.signature_checks = 0  # signature verifications made (cache misses, per key)
        self._cache: OrderedDict[str, _Entry] = OrderedDict()
        self._rejected: OrderedDict[str, str] = OrderedDict()
        self.revoked: frozenset[str] = frozenset()
        self._revoked_path = None if revoked_file is None else Path(revoked_file)
        self._revoked_sig: tuple | None = None
        self._revoked_next_check = 0.0
        self._revoked_missing_logged = False
        if self._revoked_path is not None:
            try:
                st = os.stat(self._revoked_path)
            except OSError as e:
                raise ValueError(
                    f"cannot read revoked file {self._revoked_path}: {e.strerror}"
                ) from None
            self._load_revoked(st, strict=True)
            self._revoked_next_check = clock() + revoked_check_interval

    # -- revocation ----------------------------------------------------------------------

    def reload_revoked(self) -> None:
        """Re-read the revoked file now if it changed (verify does this once a second)."""
        if self._revoked_path is None:
            return
        self._revoked_next_check = self._clock() + self.revoked_check_interval
        try:
            st = os.stat(self._revoked_path)
        except OSError as e:
            if not self._revoked_missing_logged:
                log.warning(
                    "revoked file %s: %s; keeping the %d revoked ids read before",
                    self._revoked_path,
                    e.strerror,
                    len(self.revoked),
                )
                self._revoked_missing_logged = True
            return
        self._revoked_missing_logged = False
        if (st.st_mtime_ns, st.st_size, st.st_ino) != self._revoked_sig:
            self._load_revoked(st, strict=False)

    def _load_revoked(self, st: os.stat_result, *, strict: bool) -> None:
        path = self._revoked_path
        assert path is not None
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            if strict:
                raise ValueError(f"cannot read revoked file {path}: {e}") from None
            log.warning("revoked file %s: %s; keeping the previous list", path, e)
            return
        revoked = set()
        for line in text.splitlines():
            entry = line.split("#", 1)[0].strip()
            if entry:
                revoked.add(entry)
        self.revoked = frozenset(revoked)
        self._revoked_sig = (st.st_mtime_ns, st.st_size, st.st_ino)
        log.info("revoked file %s: %d key ids / token ids", path, len(revoked))

    # -- verification --------------------------------------------------------------------

    def verify(self, token: str) -> Identity:
        """The Identity a signed key stands for; AuthenticationError says why not."""
        now = self._clock()
        if self._revoked_path is not None and now >= self._revoked_next_check:
            self.reload_revoked()
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
            message = f"token for key {identity.key_id!r} expired at {_iso(entry.exp)}"
            self._remember_rejection(token, message)
            raise AuthenticationError(message)
        if entry.nbf is not None and now < entry.nbf - self.leeway:
            raise AuthenticationError(
                f"token for key {identity.key_id!r} is not valid before {_iso(entry.nbf)}"
            )
        revoked = self.revoked
        if revoked:
            if identity.key_id in revoked:
                raise AuthenticationError(f"key {identity.key_id!r} is revoked")
            if entry.jti is not None and entry.jti in revoked:
                raise AuthenticationError(
                    f"token {entry.jti!r} of key {identity.key_id!r} is revoked"
                )
        return identity

    def cached(self, token: str) -> bool:
        """Whether `token` has been verified and is still cached (tests, metrics)."""
        return token in self._cache

    def _remember_rejection(self, token: str, message: str) -> None:
        rejected = self._rejected
        rejected[token] = message
        while len(rejected) > REJECTED_CACHE_SIZE:
            try:
                rejected.popitem(last=False)
            except KeyError:
                break

    def _verify_uncached(self, token: str) -> _Entry:
        message = self._rejected.get(token)
        if message is not None:
            raise AuthenticationError(message)
        try:
            entry = self._decode(token)
        except _Permanent as e:
            self._remember_rejection(token, str(e))
            raise AuthenticationError(str(e)) from None
        cache = self._cache
        cache[token] = entry
        while len(cache) > self.cache_size:
            try:
                cache.popitem(last=False)
            except KeyError:
                break
        return entry

    def _candidates(self, header: dict) -> list[_PublicKey]:
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
            except jwt.MissingRequiredClaimError as e:
                if e.claim == "aud":
                    raise _Permanent(
                        f"token has no audience (aud); expected {self.audience!r}"
                    ) from None
                raise _Permanent(f"token lacks the claim {e.claim!r}") from None
            except jwt.InvalidAudienceError:
                aud = jwt.decode(token, options={"verify_signature": False}).get("aud")
                raise _Permanent(f"token is for audience {aud!r}, not {self.audience!r}") from None
            except jwt.DecodeError as e:
                raise _Permanent(f"malformed token: {e}") from None
            except jwt.PyJWTError as e:
                raise _Permanent(f"invalid token: {e}") from None
        if payload is None:
            raise _Permanent("bad signature: the token is not signed by a configured key")
        try:
            identity = identity_from_claims(payload)
        except ValueError as e:
            raise _Permanent(f"invalid claims: {e}") from None
        return _Entry(identity, identity.expires_at, _numeric_date(payload, "nbf"))


# ---------------------------------------------------------------------------------------
# Command line: `zerohop keys sign` and `zerohop keys keygen` (wired by zerohop/cli.py)

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(w|d|h|m|s)", re.IGNORECASE)
_UNIT_SECONDS = {"w": 604800, "d": 86400, "h": 3600, "m": 60, "s": 1}


def parse_duration_or_time(text: str, *, now: float | None = None) -> float:
    """Unix seconds: now + a duration ("30d", "12h", "1d12h", "90m", "2w", "45s") or an
    ISO-8601 time ("2026-01-31", "2026-01-31T12:00:00Z"; no offset means UTC)."""
    s = text.strip()
    now = time.time() if now is None else now
    if s and _DURATION.sub("", s).strip() == "" and s[0].isdigit():
        return now + sum(float(n) * _UNIT_SECONDS[u.lower()] for n, u in _DURATION.findall(s))
    try:
        t = datetime.fromisoformat(s)
    except ValueError:
        raise ValueError(
            f"{text!r} is neither a duration (30d, 12h, 90m, 2w) nor an ISO-8601 time"
        ) from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return t.timestamp()


_BUDGET = re.compile(r"\s*(\d[\d_]*)\s*(?:/\s*([a-z]+))?\s*", re.IGNORECASE)


def parse_budget(text: str) -> Budget:
    """A token budget: "5000/day", "1000000/month", "1_000_000/month", "5000" (total)."""
    m = _BUDGET.fullmatch(text)
    if not m or m.group(1).endswith("_"):
        raise ValueError(f"budget {text!r}: expected TOKENS, TOKENS/day or TOKENS/month")
    period = (m.group(2) or "total").lower()
    if period not in BUDGET_PERIODS:
        raise ValueError(f"budget {text!r}: period must be one of {', '.join(BUDGET_PERIODS)}")
    return Budget(int(m.group(1).replace("_", "")), period)


def _argtype(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = parse.__name__
    return convert


def _count(text: str) -> int:
    value = int(text.replace("_", ""))
    if value < 0:
        raise ValueError(f"{text!r} is negative")
    return value


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"{text!r} is not > 0")
    return value


def add_sign_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `zerohop keys sign` (prints one signed key on stdout)."""
    p = parser
    p.add_argument("--private-key", required=True, metavar="FILE", help="PEM private key")
    p.add_argument("--key-id", required=True, metavar="ID", help="the key id (claim sub)")
    p.add_argument("--tenant", required=True, help="the tenant's name")
    p.add_argument("--name", default="", help="a label for the key")
    p.add_argument("--models", default="", metavar="A,B", help="allowed models (default: all)")
    p.add_argument("--priority", choices=PRIORITY_CLASSES, default="interactive")
    count, budget = _argtype(_count), _argtype(parse_budget)
    for prefix, whose in (("", "the key"), ("tenant-", "the whole tenant")):
        g = p.add_argument_group(f"limits of {whose}")
        g.add_argument(f"--{prefix}rpm", type=count, metavar="N", help="requests per minute")
        g.add_argument(f"--{prefix}itpm", type=count, metavar="N", help="input tokens/minute")
        g.add_argument(f"--{prefix}otpm", type=count, metavar="N", help="output tokens/minute")
        g.add_argument(
            f"--{prefix}max-concurrency", type=count, metavar="N", help="requests in flight"
        )
        g.add_argument(
            f"--{prefix}budget",
            type=budget,
            metavar="N[/day|/month]",
            help="token budget: 5000/day, 1000000/month, or 5000 (in total)",
        )
    p.add_argument(
        "--tenant-weight", type=_argtype(_positive), default=1.0, help="fair-share weight"
    )
    when = _argtype(parse_duration_or_time)
    p.add_argument(
        "--expires", type=when, metavar="WHEN", help="30d, 12h, or an ISO-8601 time (UTC)"
    )
    p.add_argument("--not-before", type=when, metavar="WHEN", help="like --expires")
    p.add_argument("--audience", default=DEFAULT_AUDIENCE, help="claim aud (%(default)s)")
    p.add_argument("--jti", default=None, help="the token's id (default: random)")
    p.add_argument("--kid", default=None, help="header kid: the signing key's id in a JWKS")


def _limits_args(args: argparse.Namespace, prefix: str) -> Limits:
    return Limits(**{f: getattr(args, prefix + f) for f in _LIMIT_FIELDS})


def cmd_sign(args: argparse.Namespace) -> int:
    """`zerohop keys sign`: print one signed key (a JWT) on stdout."""
    try:
        private_pem = Path(args.private_key).read_bytes()
    except OSError as e:
        print(f"zerohop keys sign: {args.private_key}: {e.strerror}", file=sys.stderr)
        return 1
    now = time.time()
    identity = Identity(
        key_id=args.key_id,
        tenant=Tenant(
            args.tenant,
            limits=_limits_args(args, "tenant_"),
            budget=args.tenant_budget,
            weight=args.tenant_weight,
        ),
        name=args.name,
        models=tuple(m.strip() for m in args.models.split(",") if m.strip()),
        priority=args.priority,
        limits=_limits_args(args, ""),
        budget=args.budget,
        expires_at=args.expires,
    )
    claims = claims_from_identity(identity)
    if args.expires is not None and args.expires <= now:
        print(f"zerohop keys sign: --expires {_iso(args.expires)} is past", file=sys.stderr)
        return 2
    if args.not_before is not None:
        claims["nbf"] = int(args.not_before)
    if args.jti:
        claims["jti"] = args.jti
    try:
        token = sign(
            private_pem, claims, expires_in=None, audience=args.audience, kid=args.kid, now=now
        )
    except ValueError as e:
        print(f"zerohop keys sign: {e}", file=sys.stderr)
        return 1
    if args.expires is None:
        print(
            f"zerohop keys sign: this key never expires; revoke it by listing {args.key_id!r}"
            " in the --revoked file",
            file=sys.stderr,
        )
    print(token)
    return 0


def add_keygen_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `zerohop keys keygen` (writes a signing key pair)."""
    p = parser
    p.add_argument("--out-private", required=True, metavar="FILE", help="PEM private key (0600)")
    p.add_argument("--out-public", required=True, metavar="FILE", help="PEM public key")
    p.add_argument("--kind", choices=("ed25519", "es256"), default="ed25519")
    p.add_argument("--out-jwks", metavar="FILE", help="also write the public key as a JWKS")
    p.add_argument("--kid", default=None, help="kid of the key in the JWKS")
    p.add_argument("--force", action="store_true", help="overwrite existing files")


def _write(path: str, data: bytes, mode: int, force: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    fd = os.open(path, flags, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def cmd_keygen(args: argparse.Namespace) -> int:
    """`zerohop keys keygen`: write a new private (0600) and public key, PEM (+ JWKS)."""
    private_pem, public_pem = generate_keypair(args.kind)
    outputs = [(args.out_private, private_pem, 0o600), (args.out_public, public_pem, 0o644)]
    if args.out_jwks:
        jwks = {"keys": [public_jwk(public_pem, args.kid)]}
        outputs.append((args.out_jwks, (json.dumps(jwks, indent=2) + "\n").encode(), 0o644))
    if not args.force:
        existing = [path for path, _, _ in outputs if os.path.exists(path)]
        if existing:
            print(
                f"zerohop keys keygen: {', '.join(existing)} exists (--force overwrites)",
                file=sys.stderr,
            )
            return 1
    try:
        for path, data, mode in outputs:
            _write(path, data, mode, args.force)
    except OSError as e:
        print(f"zerohop keys keygen: {e.filename}: {e.strerror}", file=sys.stderr)
        return 1
    public = args.out_jwks or args.out_public
    print(
        f"wrote {args.kind} private key {args.out_private} (keep it secret; it signs keys"
        f" with `zerohop keys sign`) and public key {args.out_public}"
        + (f" and JWKS {args.out_jwks}" if args.out_jwks else "")
        + f"; serve with --jwt-public-key {public}"
    )
    return 0
