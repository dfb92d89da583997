"""The operator's signing keys: public key files (PEM, JWKS), key pairs, and signing.

Keys and algorithms
    The public key file is PEM (one or more `PUBLIC KEY` blocks, Ed25519 or EC P-256) or a
    JWKS JSON file (`{"keys": [...]}` or a single JWK) with OKP/Ed25519 and EC/P-256 keys;
    other JWKs in the set (RSA, other curves, `use: enc`) are skipped. Each key verifies
    exactly one algorithm: EdDSA for Ed25519, ES256 for P-256 (`PublicKey.alg`), and the
    verifier (`zerohop.gateway.keys.signed_tokens`) gives PyJWT only that one.

`generate_keypair` makes a new pair (`zerohop keys keygen`), `public_jwk` turns a public PEM
into a JWK for a JWKS file, and `sign` mints a signed key from a private PEM (`zerohop keys
sign`, tests), checking its claims against the schema (`zerohop.gateway.keys.signed_claims`).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from zerohop.gateway.keys.signed_claims import identity_from_claims

DEFAULT_AUDIENCE = "zerohop"
ALGORITHMS = ("EdDSA", "ES256")


class PublicKey:
    """One public key of the file: the key, the one algorithm it verifies, its JWKS kid."""

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


def _load_pem_keys(data: bytes, source: str) -> list[PublicKey]:
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
        keys.append(PublicKey(key, alg, None))
    if not keys:
        raise ValueError(f"{source} holds no PEM 'PUBLIC KEY' block")
    return keys


def _load_jwks(data: bytes, source: str) -> list[PublicKey]:
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
        algorithm: type[jwt.algorithms.Algorithm]
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
        keys.append(PublicKey(key, alg, kid))
    if not keys:
        raise ValueError(
            f"{source} holds no Ed25519 or EC P-256 signing key (skipped: {', '.join(skipped)})"
        )
    return keys


def load_public_keys(data: bytes, source: str = "public key file") -> list[PublicKey]:
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


def public_jwk(public_pem: bytes, kid: str | None = None) -> dict[str, Any]:
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
    claims: dict[str, Any],
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
