"""Signed keys (JWTs signed by the operator): real keys, real signatures, no mocks."""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import json
import os
import stat
import time
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from zerohop.cli.keys_args import parse_budget, parse_duration_or_time
from zerohop.cli.keys_signed import (
    add_keygen_arguments,
    add_sign_arguments,
    cmd_keygen,
    cmd_sign,
)
from zerohop.gateway.keys import operator_keys as signing_keys
from zerohop.gateway.keys import signed_tokens as signed_keys
from zerohop.gateway.keys.identity import Budget, Identity, Limits, Tenant
from zerohop.gateway.keys.operator_keys import generate_keypair, public_jwk, sign
from zerohop.gateway.keys.signed_claims import claims_from_identity, identity_from_claims
from zerohop.gateway.keys.signed_tokens import (
    AuthenticationError,
    SignedKeyVerifier,
    looks_like_jwt,
)

KINDS = ("ed25519", "es256")


@pytest.fixture(scope="module")
def keys() -> dict[str, tuple[bytes, bytes]]:
    return {kind: generate_keypair(kind) for kind in KINDS}


class Clock:
    def __init__(self) -> None:
        self.t = float(int(time.time()))  # whole seconds, like exp and nbf

    def __call__(self) -> float:
        return self.t


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def write(tmp_path: Path, name: str, data: bytes | str) -> Path:
    path = tmp_path / name
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


def verifier(tmp_path: Path, public: bytes | dict, **kw) -> SignedKeyVerifier:
    data = json.dumps(public).encode() if isinstance(public, dict) else public
    return SignedKeyVerifier(write(tmp_path, "public.key", data), **kw)


FULL_CLAIMS = {
    "sub": "fleet-key-1",
    "tenant": "acme",
    "name": "acme batch jobs",
    "models": ["SmolLM2-135M-Instruct", "tiny"],
    "priority": "batch",
    "limits": {"rpm": 600, "itpm": 100_000, "otpm": 20_000, "max_concurrency": 8},
    "budget": {"tokens": 5000, "period": "day"},
    "tenant_limits": {"rpm": 6000, "max_concurrency": 64},
    "tenant_budget": {"tokens": 1_000_000, "period": "month"},
    "tenant_weight": 2.5,
}

FULL_IDENTITY = Identity(
    key_id="fleet-key-1",
    tenant=Tenant(
        "acme",
        limits=Limits(rpm=6000, max_concurrency=64),
        budget=Budget(1_000_000, "month"),
        weight=2.5,
    ),
    name="acme batch jobs",
    models=("SmolLM2-135M-Instruct", "tiny"),
    priority="batch",
    limits=Limits(rpm=600, itpm=100_000, otpm=20_000, max_concurrency=8),
    budget=Budget(5000, "day"),
    source="jwt",
)


# -- accepted tokens ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_pem_round_trip_maps_claims_to_identity(tmp_path, keys, kind):
    private, public = keys[kind]
    now = time.time()
    token = sign(private, FULL_CLAIMS, expires_in=3600, now=now)
    assert jwt.get_unverified_header(token)["alg"] == {"ed25519": "EdDSA", "es256": "ES256"}[kind]
    assert looks_like_jwt(token)
    identity = verifier(tmp_path, public).verify(token)
    expected_exp = float(int(now + 3600))
    assert identity == Identity(**{**_fields(FULL_IDENTITY), "expires_at": expected_exp})
    assert identity.source == "jwt" and identity.tenant.weight == 2.5
    assert identity.expires_at == expected_exp
    claims = jwt.decode(token, options={"verify_signature": False})
    assert claims["aud"] == "zerohop" and claims["iat"] == int(now)
    assert identity.extra == {"jti": claims["jti"], "iat": float(int(now))}
    assert len(claims["jti"]) == 32
    assert "kid" not in claims  # the key id is sub


def _fields(identity: Identity) -> dict:
    return {f: getattr(identity, f) for f in Identity.__dataclass_fields__}


def test_minimal_claims_and_defaults(tmp_path, keys):
    private, public = keys["ed25519"]
    token = sign(private, {"sub": "k", "tenant": "t"}, expires_in=None)
    identity = verifier(tmp_path, public, allow_nonexpiring=True).verify(token)
    assert identity == Identity(key_id="k", tenant=Tenant("t"), source="jwt")
    assert identity.expires_at is None and identity.allows_model("anything")


def test_a_token_without_exp_is_refused_unless_allowed(tmp_path, keys):
    """Issue 19 failure 7: a signed key without `exp` was accepted and never expired."""
    private, public = keys["ed25519"]
    token = sign(private, {"sub": "k", "tenant": "t"}, expires_in=None)
    strict = verifier(tmp_path, public)
    assert not strict.allow_nonexpiring  # the default
    for _ in range(2):  # and remembered as refused: no second signature check
        with pytest.raises(
            AuthenticationError, match=r"token for key 'k' has no expiry \(claim 'exp'\)"
        ):
            strict.verify(token)
    assert strict.signature_checks == 1
    expiring = sign(private, {"sub": "k", "tenant": "t"}, expires_in=60)
    assert strict.verify(expiring).expires_at is not None
    assert verifier(tmp_path, public, allow_nonexpiring=True).verify(token).expires_at is None


def test_claims_identity_round_trip():
    identity = Identity(**{**_fields(FULL_IDENTITY), "expires_at": 2_000_000_000.0})
    claims = claims_from_identity(identity)
    assert claims == {**FULL_CLAIMS, "exp": 2_000_000_000}
    assert identity_from_claims(claims) == identity


@pytest.mark.parametrize(
    "admin, inference, claims",
    [(True, False, {"admin": True}), (True, True, {"admin": True, "inference": True}),
     (False, True, {})],
)  # fmt: skip
def test_admin_claims_round_trip(admin, inference, claims):
    identity = Identity("k", Tenant("ops"), source="jwt", admin=admin, inference=inference)
    made = claims_from_identity(identity)
    assert {k: v for k, v in made.items() if k in ("admin", "inference")} == claims
    assert identity_from_claims(made) == identity


@pytest.mark.parametrize(
    "claims, message",
    [
        ({"tenant": "t"}, "'sub'"),
        ({"sub": "k"}, "'tenant'"),
        ({"sub": "k", "tenant": "t", "priority": "urgent"}, "'priority'"),
        ({"sub": "k", "tenant": "t", "models": "tiny"}, "'models'"),
        ({"sub": "k", "tenant": "t", "limits": {"rmp": 5}}, r"unknown fields \['rmp'\]"),
        ({"sub": "k", "tenant": "t", "limits": {"rpm": -1}}, "limits.rpm"),
        ({"sub": "k", "tenant": "t", "limits": {"rpm": True}}, "limits.rpm"),
        ({"sub": "k", "tenant": "t", "budget": {"tokens": 5, "period": "week"}}, "period"),
        ({"sub": "k", "tenant": "t", "tenant_budget": {"period": "day"}}, "'tokens'"),
        ({"sub": "k", "tenant": "t", "tenant_weight": 0}, "tenant_weight"),
        ({"sub": "k", "tenant": "t", "tenant_weight": -1}, "tenant_weight"),
        ({"sub": "k", "tenant": "t", "tenant_weight": float("inf")}, "tenant_weight"),
        ({"sub": "k", "tenant": "t", "budget": {"tokens": 0}}, "budget.tokens"),
        ({"sub": "k", "tenant": "t", "tenant_budget": {"tokens": -5}}, "tenant_budget.tokens"),
        ({"sub": "k", "tenant": "t", "tenant_limits": {"otpm": -1}}, "tenant_limits.otpm"),
        ({"sub": "k", "tenant": "t", "limits": {"max_concurrency": 1.5}}, "max_concurrency"),
        ({"sub": "k", "tenant": "t", "exp": "tomorrow"}, "'exp'"),
        ({"sub": "k", "tenant": "t", "admin": "yes"}, "'admin'"),
        ({"sub": "k", "tenant": "t", "admin": True, "inference": 1}, "'inference'"),
    ],
)
def test_bad_claims_are_refused(tmp_path, keys, claims, message):
    with pytest.raises(ValueError, match=message):
        identity_from_claims(claims)
    with pytest.raises(ValueError, match=message):
        sign(keys["ed25519"][0], claims, expires_in=None)  # never mints a refused token
    # and a token carrying them, signed without the schema check, is refused by verify
    token = _encode_raw(keys["ed25519"][0], {**claims, "aud": "zerohop"})
    with pytest.raises(AuthenticationError, match="invalid claims: .*" + message):
        verifier(tmp_path, keys["ed25519"][1]).verify(token)


def _encode_raw(private_pem: bytes, payload: dict, algorithm: str = "EdDSA", **kw) -> str:
    """A properly signed token with exactly `payload` (no schema check, no defaults)."""
    key = signing_keys._load_private_key(private_pem)[0]
    return jwt.encode(payload, key, algorithm=algorithm, **kw)


def test_jwks_selects_by_kid_or_tries_each(tmp_path, keys):
    ed_private, ed_public = keys["ed25519"]
    es_private, es_public = keys["es256"]
    other_private, other_public = generate_keypair("ed25519")
    rsa_jwk = jwt.algorithms.RSAAlgorithm.to_jwk(
        rsa.generate_private_key(public_exponent=65537, key_size=2048).public_key(),
        as_dict=True,
    )
    jwks = {
        "keys": [
            {**rsa_jwk, "kid": "rsa"},  # skipped: not Ed25519 / P-256
            public_jwk(ed_public, "ed-1"),
            public_jwk(es_public, "es-1"),
            public_jwk(other_public, "ed-2"),
        ]
    }
    v = verifier(tmp_path, jwks)
    assert sorted((k.kid, k.alg) for k in v.keys) == [
        ("ed-1", "EdDSA"),
        ("ed-2", "EdDSA"),
        ("es-1", "ES256"),
    ]
    claims = {"sub": "k", "tenant": "t"}
    for private, kid in ((ed_private, "ed-1"), (es_private, "es-1"), (other_private, "ed-2")):
        assert v.verify(sign(private, claims, expires_in=60, kid=kid)).key_id == "k"
    # no kid in the header: each key of the token's algorithm is tried
    checks = v.signature_checks
    assert v.verify(sign(other_private, claims, expires_in=60)).tenant.name == "t"
    assert v.signature_checks - checks in (1, 2)
    # a kid that names another key: only that key is tried, and it does not match
    with pytest.raises(AuthenticationError, match="bad signature"):
        v.verify(sign(other_private, claims, expires_in=60, kid="ed-1"))
    with pytest.raises(AuthenticationError, match="no configured public key has the token's kid"):
        v.verify(sign(ed_private, claims, expires_in=60, kid="nope"))
    with pytest.raises(AuthenticationError, match="does not verify ES256"):
        v.verify(sign(es_private, claims, expires_in=60, kid="ed-1"))
    # a single JWK (not a set) also works; a private JWK is used for its public half only
    private_jwk = jwt.algorithms.OKPAlgorithm.to_jwk(
        signing_keys._load_private_key(ed_private)[0], as_dict=True
    )
    assert "d" in private_jwk
    single = SignedKeyVerifier(write(tmp_path, "one.jwk", json.dumps(private_jwk)))
    assert single.verify(sign(ed_private, claims, expires_in=60)).key_id == "k"


def test_pem_file_with_two_keys_for_rotation(tmp_path, keys):
    v = verifier(tmp_path, keys["ed25519"][1] + keys["es256"][1])
    assert v.algorithms == {"EdDSA", "ES256"}
    for kind in KINDS:
        assert v.verify(sign(keys[kind][0], {"sub": kind, "tenant": "t"}, expires_in=60)).key_id


def test_public_key_file_errors(tmp_path, keys):
    with pytest.raises(ValueError, match="holds a private key"):
        verifier(tmp_path, keys["ed25519"][0])
    rsa_pem = (
        rsa.generate_private_key(public_exponent=65537, key_size=2048)
        .public_key()
        .public_bytes(
            signing_keys.serialization.Encoding.PEM,
            signing_keys.serialization.PublicFormat.SubjectPublicKeyInfo,
        )
    )
    with pytest.raises(ValueError, match="RSAPublicKey key; only Ed25519 and EC P-256"):
        verifier(tmp_path, rsa_pem)
    p384 = (
        ec.generate_private_key(ec.SECP384R1())
        .public_key()
        .public_bytes(
            signing_keys.serialization.Encoding.PEM,
            signing_keys.serialization.PublicFormat.SubjectPublicKeyInfo,
        )
    )
    with pytest.raises(ValueError, match="EC secp384r1 key"):
        verifier(tmp_path, p384)
    with pytest.raises(ValueError, match="no PEM 'PUBLIC KEY' block"):
        verifier(tmp_path, b"hello")
    with pytest.raises(ValueError, match="holds no Ed25519 or EC P-256 signing key"):
        verifier(tmp_path, {"keys": [{"kty": "oct", "k": "c2VjcmV0"}]})
    with pytest.raises(ValueError, match="cannot read public key file"):
        SignedKeyVerifier(tmp_path / "missing.pem")
    with pytest.raises(ValueError, match="cannot read revoked file"):
        verifier(tmp_path, keys["ed25519"][1], revoked_file=tmp_path / "missing.txt")


# -- refused tokens ----------------------------------------------------------------------


def _unsigned(header: dict, payload: dict) -> str:
    return f"{b64(json.dumps(header).encode())}.{b64(json.dumps(payload).encode())}"


def test_alg_none_is_refused(tmp_path, keys):
    v = verifier(tmp_path, keys["ed25519"][1])
    payload = {"sub": "k", "tenant": "t", "aud": "zerohop", "exp": time.time() + 60}
    for alg in ("none", "None", "NONE"):
        token = _unsigned({"alg": alg, "typ": "JWT"}, payload) + "."
        assert looks_like_jwt(token)  # the server must route it here, and refuse it
        with pytest.raises(AuthenticationError, match=f"token algorithm '{alg}' is not allowed"):
            v.verify(token)
    assert v.signature_checks == 0


@pytest.mark.parametrize("kind", KINDS)
def test_algorithm_confusion_hs256_with_the_public_key_is_refused(tmp_path, keys, kind):
    public = keys[kind][1]
    v = verifier(tmp_path, public)
    payload = {"sub": "k", "tenant": "t", "aud": "zerohop", "exp": int(time.time()) + 60}
    signing_input = _unsigned({"alg": "HS256", "typ": "JWT"}, payload)
    for secret in (public, public.strip(), b64(public).encode()):
        mac = hmac.new(secret, signing_input.encode(), hashlib.sha256).digest()
        with pytest.raises(AuthenticationError, match="token algorithm 'HS256' is not allowed"):
            v.verify(f"{signing_input}.{b64(mac)}")
    assert v.signature_checks == 0


def test_es256_token_for_an_ed25519_verifier_is_refused(tmp_path, keys):
    v = verifier(tmp_path, keys["ed25519"][1])
    token = sign(keys["es256"][0], {"sub": "k", "tenant": "t"}, expires_in=60)
    with pytest.raises(
        AuthenticationError, match=r"signed with ES256, but the configured public key.* only EdDSA"
    ):
        v.verify(token)
    # and a token from another Ed25519 key: the signature does not verify
    token = sign(generate_keypair("ed25519")[0], {"sub": "k", "tenant": "t"}, expires_in=60)
    with pytest.raises(AuthenticationError, match="bad signature"):
        v.verify(token)


@pytest.mark.parametrize("kind", KINDS)
def test_expired_and_not_yet_valid(tmp_path, keys, kind):
    private, public = keys[kind]
    v = verifier(tmp_path, public)
    claims = {"sub": "k", "tenant": "t"}
    with pytest.raises(AuthenticationError, match="token for key 'k' expired at 20"):
        v.verify(sign(private, claims, expires_in=-60))
    with pytest.raises(AuthenticationError, match="token for key 'k' is not valid before 20"):
        v.verify(sign(private, {**claims, "nbf": int(time.time()) + 60}, expires_in=600))
    # within the 5 s leeway: accepted
    assert v.verify(sign(private, claims, expires_in=-2)).key_id == "k"
    assert v.verify(sign(private, {**claims, "nbf": int(time.time()) + 2}, expires_in=60))
    strict = verifier(tmp_path, public, leeway=0)
    with pytest.raises(AuthenticationError, match="expired"):
        strict.verify(sign(private, claims, expires_in=-2))


def test_audience(tmp_path, keys):
    private, public = keys["ed25519"]
    claims = {"sub": "k", "tenant": "t"}
    v = verifier(tmp_path, public)
    with pytest.raises(AuthenticationError, match="token is for audience 'other', not 'zerohop'"):
        v.verify(sign(private, claims, expires_in=60, audience="other"))
    with pytest.raises(AuthenticationError, match=r"no audience \(aud\); expected 'zerohop'"):
        v.verify(_encode_raw(private, {**claims, "exp": int(time.time()) + 60}))
    assert v.verify(sign(private, {**claims, "aud": ["other", "zerohop"]}, expires_in=60))
    fleet = verifier(tmp_path, public, audience="fleet-a")
    assert fleet.verify(sign(private, claims, expires_in=60, audience="fleet-a")).key_id == "k"
    with pytest.raises(AuthenticationError, match="not 'fleet-a'"):
        fleet.verify(sign(private, claims, expires_in=60))


@pytest.mark.parametrize("kind", KINDS)
def test_bad_signature(tmp_path, keys, kind):
    private, public = keys[kind]
    v = verifier(tmp_path, public)
    token = sign(private, {"sub": "k", "tenant": "t"}, expires_in=60)
    head, payload, sig = token.split(".")
    raw = bytearray(base64.urlsafe_b64decode(sig + "=="))
    raw[len(raw) // 2] ^= 0x01
    with pytest.raises(AuthenticationError, match="bad signature"):
        v.verify(f"{head}.{payload}.{b64(bytes(raw))}")
    # a changed payload with the original signature
    forged = b64(json.dumps({"sub": "admin", "tenant": "t", "aud": "zerohop"}).encode())
    with pytest.raises(AuthenticationError, match="bad signature"):
        v.verify(f"{head}.{forged}.{sig}")
    with pytest.raises(AuthenticationError, match="bad signature"):
        v.verify(f"{head}.{payload}.")
    assert v.verify(token).key_id == "k"


def test_garbage(tmp_path, keys):
    v = verifier(tmp_path, keys["ed25519"][1])
    for token, message in [
        ("", "empty token"),
        ("zh-0123456789abcdef", "not a JWT"),
        ("a.b", "not a JWT"),
        ("a.b.c.d", "not a JWT"),
        ("a b.c.d", "not a JWT"),
        ("abc.def.ghi", "malformed token header"),
        (b64(b"[1, 2]") + ".e30.", "malformed token header"),
        ("x" * 20000, "longer than"),
    ]:
        with pytest.raises(AuthenticationError, match=message):
            v.verify(token)
        assert not looks_like_jwt(token) or token.startswith(b64(b"[1"))
    assert v.signature_checks == 0


def test_looks_like_jwt(keys):
    assert looks_like_jwt(sign(keys["es256"][0], {"sub": "k", "tenant": "t"}, expires_in=None))
    assert looks_like_jwt(_unsigned({"alg": "none"}, {}) + ".")
    for token in ("zh-abc", "zh-abc.def.ghi", "", "a.b.c", _unsigned({"typ": "JWT"}, {}) + ".x"):
        assert not looks_like_jwt(token)
    assert not looks_like_jwt(b64(b"[1, 2]") + ".e30.")


# -- revocation --------------------------------------------------------------------------


def test_revoked_by_sub_and_by_jti_reloaded_on_change(tmp_path, keys, monkeypatch):
    private, public = keys["ed25519"]
    revoked = write(tmp_path, "revoked.txt", "# revoked keys\n\nkey-a   # leaked\njti-b\n")
    clock = Clock()
    v = verifier(tmp_path, public, revoked_file=revoked, clock=clock)
    assert v.revoked == {"key-a", "jti-b"}
    a = sign(private, {"sub": "key-a", "tenant": "t"}, expires_in=600)
    b = sign(private, {"sub": "key-b", "tenant": "t", "jti": "jti-b"}, expires_in=600)
    c = sign(private, {"sub": "key-c", "tenant": "t"}, expires_in=600)
    with pytest.raises(AuthenticationError, match="key 'key-a' is revoked"):
        v.verify(a)
    with pytest.raises(AuthenticationError, match="token 'jti-b' of key 'key-b' is revoked"):
        v.verify(b)
    assert v.verify(c).key_id == "key-c"
    checks = v.signature_checks

    # un-revoke key-a, revoke key-c: seen once the next check is due (<= 1 s later)
    revoked.write_text("jti-b\nkey-c\n")
    st = revoked.stat()
    os.utime(revoked, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    stats = count_stats(monkeypatch, revoked)
    clock.t += 0.5
    for _ in range(100):
        assert v.verify(c).key_id == "key-c"  # not re-read yet
    assert stats == []  # 100 verifications within the interval: not one stat()
    clock.t += 0.6
    assert v.verify(a).key_id == "key-a"
    assert len(stats) == 1  # the first verification once it was due: one stat(), re-read
    with pytest.raises(AuthenticationError, match="key 'key-c' is revoked"):
        v.verify(c)
    with pytest.raises(AuthenticationError, match="'jti-b'"):
        v.verify(b)
    assert v.signature_checks == checks  # revocation is checked on cache hits too

    # the file disappearing keeps the last list
    revoked.unlink()
    clock.t += 1.1
    with pytest.raises(AuthenticationError, match="key 'key-c' is revoked"):
        v.verify(c)
    # and it coming back is read again
    revoked.write_text("")
    clock.t += 1.1
    assert v.verify(c).key_id == "key-c"


def test_revoked_reload_with_the_real_clock(tmp_path, keys, monkeypatch):
    private, public = keys["es256"]
    revoked = write(tmp_path, "revoked.txt", "")
    v = verifier(tmp_path, public, revoked_file=revoked)
    token = sign(private, {"sub": "k", "tenant": "t"}, expires_in=600)
    assert v.verify(token).key_id == "k"
    revoked.write_text("k\n")
    st = revoked.stat()
    os.utime(revoked, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    stats = count_stats(monkeypatch, revoked)
    deadline = time.monotonic() + 30  # a safety net: the real clock makes the check due
    while True:
        try:
            v.verify(token)
        except AuthenticationError as exc:
            assert "key 'k' is revoked" in str(exc)
            break
        assert stats == [], "the file was checked, yet the key is not revoked"
        assert time.monotonic() < deadline, "the revoked file was never checked again"
        time.sleep(0.01)
    assert len(stats) == 1  # one stat() when the check came due, and that one re-read it
    with pytest.raises(AuthenticationError, match="key 'k' is revoked"):
        v.verify(token)


def count_stats(monkeypatch: pytest.MonkeyPatch, path: Path) -> list[Path]:
    """Each os.stat() of `path` from now on (the real one is still called)."""
    real_stat, seen = os.stat, []

    def counting_stat(target, *args, **kwargs):
        if isinstance(target, str | os.PathLike) and Path(target) == path:
            seen.append(path)
        return real_stat(target, *args, **kwargs)

    monkeypatch.setattr(os, "stat", counting_stat)
    return seen


# -- the cache ---------------------------------------------------------------------------


def test_same_token_10000_times_costs_one_signature_check(tmp_path, keys, monkeypatch):
    private, public = keys["ed25519"]
    v = verifier(tmp_path, public, revoked_file=write(tmp_path, "revoked.txt", "other\n"))
    calls = []
    real_decode = signed_keys.jwt.decode

    def counting_decode(*args, **kwargs):
        calls.append(args)
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(signed_keys.jwt, "decode", counting_decode)
    token = sign(private, FULL_CLAIMS, expires_in=600)
    first = v.verify(token)
    for _ in range(9_999):
        assert v.verify(token) is first
    assert len(calls) == 1 and v.signature_checks == 1
    other = sign(private, {**FULL_CLAIMS, "sub": "k2"}, expires_in=600)
    assert v.verify(other).key_id == "k2"
    assert len(calls) == 2 and v.signature_checks == 2


def test_expired_while_cached_is_refused(tmp_path, keys):
    private, public = keys["es256"]
    clock = Clock()
    v = verifier(tmp_path, public, clock=clock, leeway=1)
    token = sign(private, {"sub": "k", "tenant": "t"}, expires_in=10, now=clock.t)
    assert v.verify(token).key_id == "k"
    clock.t += 10.5  # past exp, within the leeway
    assert v.verify(token).key_id == "k"
    clock.t += 1.0
    with pytest.raises(AuthenticationError, match="token for key 'k' expired at"):
        v.verify(token)
    assert not v.cached(token)
    with pytest.raises(AuthenticationError, match="expired"):
        v.verify(token)
    assert v.signature_checks == 1


def test_not_yet_valid_becomes_valid_without_a_second_check(tmp_path, keys):
    private, public = keys["ed25519"]
    clock = Clock()
    v = verifier(tmp_path, public, clock=clock, leeway=0)
    token = sign(private, {"sub": "k", "tenant": "t", "nbf": int(clock.t) + 30}, expires_in=600)
    with pytest.raises(AuthenticationError, match="not valid before"):
        v.verify(token)
    clock.t += 31
    assert v.verify(token).key_id == "k"
    assert v.signature_checks == 1


def test_refused_tokens_are_remembered(tmp_path, keys):
    v = verifier(tmp_path, keys["ed25519"][1])
    token = sign(generate_keypair("ed25519")[0], {"sub": "k", "tenant": "t"}, expires_in=60)
    for _ in range(100):
        with pytest.raises(AuthenticationError, match="bad signature"):
            v.verify(token)
    assert v.signature_checks == 1


def test_cache_is_bounded_lru(tmp_path, keys):
    private, public = keys["ed25519"]
    v = verifier(tmp_path, public, cache_size=2)
    a, b, c = (sign(private, {"sub": s, "tenant": "t"}, expires_in=60) for s in "abc")
    v.verify(a)
    v.verify(b)
    v.verify(a)  # a is now the most recently used
    v.verify(c)  # evicts b
    assert v.cached(a) and v.cached(c) and not v.cached(b)
    assert v.signature_checks == 3
    v.verify(b)
    assert v.signature_checks == 4


# -- parsers and the command line --------------------------------------------------------


def test_parse_budget():
    assert parse_budget("5000/day") == Budget(5000, "day")
    assert parse_budget("1000000/month") == Budget(1_000_000, "month")
    assert parse_budget("1_000_000 / Month") == Budget(1_000_000, "month")
    assert parse_budget("5000") == Budget(5000, "total")
    assert parse_budget("5000/total") == Budget(5000, "total")
    for bad in ("", "-5", "0", "0/day", "5000/week", "5k/day", "day", "5000/", "1_/day"):
        with pytest.raises(ValueError, match="budget"):
            parse_budget(bad)


def test_parse_duration_or_time():
    now = 1_700_000_000.0
    assert parse_duration_or_time("30d", now=now) == now + 30 * 86400
    assert parse_duration_or_time("12h", now=now) == now + 12 * 3600
    assert parse_duration_or_time("1d12h", now=now) == now + 36 * 3600
    assert parse_duration_or_time("90m", now=now) == now + 5400
    assert parse_duration_or_time("2w", now=now) == now + 14 * 86400
    assert parse_duration_or_time("1.5h", now=now) == now + 5400
    assert parse_duration_or_time("2026-01-31T12:00:00Z") == 1_769_860_800
    assert parse_duration_or_time("2026-01-31T12:00:00") == 1_769_860_800
    assert parse_duration_or_time("2026-01-31T13:00:00+01:00") == 1_769_860_800
    assert parse_duration_or_time("2026-01-31") == 1_769_817_600
    for bad in ("", "soon", "30", "30x", "d30", "-1d"):
        with pytest.raises(ValueError, match="neither a duration"):
            parse_duration_or_time(bad)


def _parse(add, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("kind", KINDS)
def test_cli_keygen_and_sign_round_trip(tmp_path, capsys, kind):
    priv, pub, jwks = tmp_path / "op.key", tmp_path / "op.pub", tmp_path / "op.jwks"
    argv = ["--out-private", str(priv), "--out-public", str(pub), "--kind", kind]
    assert cmd_keygen(_parse(add_keygen_arguments, [*argv, "--out-jwks", str(jwks)])) == 0
    assert "--jwt-public-key" in capsys.readouterr().out
    assert stat.S_IMODE(priv.stat().st_mode) == 0o600
    assert cmd_keygen(_parse(add_keygen_arguments, argv)) == 1  # no silent overwrite
    assert "exists" in capsys.readouterr().err

    now = time.time()
    args = _parse(
        add_sign_arguments,
        [
            "--private-key", str(priv), "--key-id", "fleet-key-1", "--tenant", "acme",
            "--name", "acme batch jobs", "--models", "SmolLM2-135M-Instruct, tiny",
            "--priority", "batch", "--rpm", "600", "--itpm", "100_000", "--otpm", "20000",
            "--max-concurrency", "8", "--budget", "5000/day", "--tenant-rpm", "6000",
            "--tenant-max-concurrency", "64", "--tenant-budget", "1000000/month",
            "--tenant-weight", "2.5", "--expires", "30d", "--jti", "j-1",
        ],
    )  # fmt: skip
    assert cmd_sign(args) == 0
    out = capsys.readouterr()
    token = out.out.strip()
    assert out.err == "" and looks_like_jwt(token)
    for public_file in (pub, jwks):
        identity = SignedKeyVerifier(public_file).verify(token)
        assert identity == Identity(**{**_fields(FULL_IDENTITY), "expires_at": identity.expires_at})
        assert identity.expires_at == pytest.approx(now + 30 * 86400, abs=5)
        assert identity.extra["jti"] == "j-1"


def test_cli_sign_errors_and_defaults(tmp_path, capsys, keys):
    priv = write(tmp_path, "op.key", keys["es256"][0])
    base = ["--private-key", str(priv), "--key-id", "k", "--tenant", "t"]
    with pytest.raises(SystemExit):  # no expiry unless asked for explicitly
        _parse(add_sign_arguments, base)
    assert "one of the arguments --expires --no-expiry is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse(add_sign_arguments, [*base, "--expires", "1h", "--no-expiry"])
    assert "not allowed with" in capsys.readouterr().err
    assert cmd_sign(_parse(add_sign_arguments, [*base, "--no-expiry"])) == 0
    out = capsys.readouterr()
    assert "never expires" in out.err and "--allow-nonexpiring-signed-keys" in out.err
    never = out.out.strip()
    identity = verifier(tmp_path, keys["es256"][1], allow_nonexpiring=True).verify(never)
    assert identity == Identity(key_id="k", tenant=Tenant("t"), source="jwt")
    with pytest.raises(AuthenticationError, match="no expiry"):
        verifier(tmp_path, keys["es256"][1]).verify(never)
    for bad, field in (("--tenant-weight", "0"), ("--tenant-weight", "nan"), ("--rpm", "-1")):
        with pytest.raises(SystemExit):
            _parse(add_sign_arguments, [*base, "--expires", "1h", bad, field])
        assert f"argument {bad}:" in capsys.readouterr().err

    assert cmd_sign(_parse(add_sign_arguments, [*base, "--expires", "2001-01-01"])) == 2
    assert "is past" in capsys.readouterr().err
    base += ["--expires", "1h"]
    args = _parse(add_sign_arguments, [*base, "--kid", "es-1", "--audience", "fleet-a"])
    assert cmd_sign(args) == 0
    token = capsys.readouterr().out.strip()
    assert jwt.get_unverified_header(token)["kid"] == "es-1"
    assert jwt.decode(token, options={"verify_signature": False})["aud"] == "fleet-a"

    args = _parse(add_sign_arguments, [*base])
    args.private_key = str(write(tmp_path, "pub.pem", keys["es256"][1]))
    assert cmd_sign(args) == 1
    assert "not an unencrypted PEM key" in capsys.readouterr().err
    args.private_key = str(tmp_path / "missing")
    assert cmd_sign(args) == 1
    with pytest.raises(SystemExit):
        _parse(add_sign_arguments, [*base, "--budget", "5/week"])
    assert "period must be one of" in capsys.readouterr().err
