"""The audit names who was refused: a request refused for its key names the key when the store
(or a verified signature) knows it, revoked, expired or otherwise, and refused admin-API and
console requests (a bad key, not an admin key, a wrong CSRF token, a cross-site request, a
dead session) are audited with the reason.

One real `zerohop serve` with a SQLite key store and a signed-key public key, its real audit
files read back (and searched through the admin API); the client-facing answers are the ones
given before. Nothing of a secret, a session cookie or a CSRF token reaches the log.
"""

from __future__ import annotations

import re
import sqlite3
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import jwt
import orjson
import pytest

from tests.live_server import MODEL_NAME, LiveServer
from zerohop.admin.sessions import COOKIE
from zerohop.gateway.audit.log import log_files, verify
from zerohop.gateway.keys.identity import KeyRef
from zerohop.gateway.keys.operator_keys import generate_keypair, sign
from zerohop.gateway.keys.signed_tokens import AuthenticationError, SignedKeyVerifier
from zerohop.gateway.store.sqlite import KeyStore

SAFETY_TIMEOUT = 30.0  # a safety net for a record that never comes, not a bound under test
UNKNOWN = "zh-" + "u" * 43
USER = [{"role": "user", "content": "hi"}]


@dataclass
class Setup:
    server: LiveServer
    audit_dir: Path
    secrets: dict[str, str]  # name -> the secret (stored keys) or token (signed keys)
    ids: dict[str, str]  # name -> key id
    private_key: bytes  # the operator's signing key

    def records(self) -> list[dict]:
        out = []
        for path in log_files(self.audit_dir):
            out += [orjson.loads(line) for line in path.read_bytes().split(b"\n")[:-1]]
        return out

    def last_seq(self) -> int:
        return max((r["seq"] for r in self.records()), default=-1)

    def record_after(self, seq: int, match: Callable[[dict], bool]) -> dict:
        """The one record after `seq` that `match`es, once the writer has written it."""
        deadline = time.monotonic() + SAFETY_TIMEOUT
        while True:
            found = [r for r in self.records() if r["seq"] > seq and match(r)]
            if found:
                assert len(found) == 1, found
                return found[0]
            assert time.monotonic() < deadline, "no such audit record"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def setup(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    folder = tmp_path_factory.mktemp("audit_refusals")
    db = folder / "keys.db"
    store = KeyStore(db)
    made = {
        "admin": store.create_key("ops", name="root", admin=True, inference=False),
        "revoked_admin": store.create_key("ops", admin=True, inference=False),
        "data": store.create_key("acme", name="app"),
        "revoked": store.create_key("acme", name="old"),
        "expired": store.create_key("acme", expires=time.time() - 60),
        "restricted": store.create_key("acme", models=["another-model"]),
        "invalid": store.create_key("beta"),
    }
    secrets = {name: secret for name, (secret, _) in made.items()}
    ids = {name: record.key_id for name, (_, record) in made.items()}
    for name in ("revoked", "revoked_admin"):
        assert store.revoke_key(ids[name])
    store.close()
    with sqlite3.connect(db) as conn:  # a row written badly by hand (an older version, sqlite3)
        conn.execute("UPDATE keys SET rpm = -5 WHERE key_id = ?", (ids["invalid"],))
    private, public = generate_keypair("ed25519")
    (folder / "op.pub").write_bytes(public)
    (folder / "revoked.txt").write_text("signed-revoked\n")
    args = ["--keys-db", str(db), "--jwt-public-key", str(folder / "op.pub"),
            "--revoked", str(folder / "revoked.txt")]  # fmt: skip
    server = LiveServer(llama_dir, args).start(folder / "server.log")
    try:
        yield Setup(server, folder / "audit", secrets, ids, private)
    finally:
        server.stop()
    everything = b"".join(path.read_bytes() for path in log_files(folder / "audit"))
    for secret in [*secrets.values(), UNKNOWN]:
        assert secret.encode() not in everything, "a secret reached the audit log"
    assert verify(folder / "audit").ok


def message(setup: Setup, key: str) -> httpx.Response:
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": USER}
    url = setup.server.url + "/v1/messages"
    return httpx.post(url, json=body, headers={"x-api-key": key}, timeout=SAFETY_TIMEOUT)


def refused_request(setup: Setup, key: str, status: int = 401) -> dict:
    """Send a Messages request with `key`, expect `status`, return its audit record."""
    seq = setup.last_seq()
    answer = message(setup, key)
    assert answer.status_code == status, answer.text
    request_id = answer.headers["request-id"]
    record = setup.record_after(seq, lambda r: r.get("request_id") == request_id)
    assert record["status"] == status and record["surface"] == "anthropic"
    assert record["client"].startswith("127.0.0.1:")
    record["message"] = answer.json()["error"]["message"]  # for the asserts on the answer
    return record


# -- the data plane ----------------------------------------------------------------------------


def test_a_revoked_key_is_named_in_the_audit_and_answered_as_an_unknown_one(setup: Setup):
    record = refused_request(setup, setup.secrets["revoked"])
    assert (record["key_id"], record["tenant"]) == (setup.ids["revoked"], "acme")
    assert record["decision"] == "authentication"
    assert record["message"] == "invalid API key (unknown or revoked)"  # no more than before
    unknown = refused_request(setup, UNKNOWN)
    assert unknown["message"] == record["message"]


def test_an_unknown_key_stays_anonymous(setup: Setup):
    record = refused_request(setup, UNKNOWN)
    assert (record["key_id"], record["tenant"]) == ("anonymous", "anonymous")
    assert record["decision"] == "authentication"
    missing = refused_request(setup, "")
    assert (missing["key_id"], missing["decision"]) == ("anonymous", "authentication")


def test_an_expired_key_is_named(setup: Setup):
    record = refused_request(setup, setup.secrets["expired"])
    assert (record["key_id"], record["tenant"]) == (setup.ids["expired"], "acme")
    assert record["decision"] == "authentication"
    assert record["message"] == f"API key {setup.ids['expired']} has expired"


def test_keys_refused_for_what_they_may_do_are_named(setup: Setup):
    admin_only = refused_request(setup, setup.secrets["admin"], 403)
    assert (admin_only["key_id"], admin_only["tenant"]) == (setup.ids["admin"], "ops")
    assert admin_only["decision"] == "permission"
    other_model = refused_request(setup, setup.secrets["restricted"], 403)
    assert (other_model["key_id"], other_model["decision"]) == (
        setup.ids["restricted"], "permission"
    )  # fmt: skip
    invalid = refused_request(setup, setup.secrets["invalid"], 403)
    assert (invalid["key_id"], invalid["tenant"]) == (setup.ids["invalid"], "beta")
    assert invalid["decision"] == "invalid_key_configuration"


def test_signed_keys_are_named_once_their_signature_verified(setup: Setup):
    claims = {"sub": "signed-1", "tenant": "fleet"}
    expired = refused_request(setup, sign(setup.private_key, claims, expires_in=-600))
    assert (expired["key_id"], expired["tenant"]) == ("signed-1", "fleet")
    assert "expired" in expired["message"]
    revoked_claims = {"sub": "signed-revoked", "tenant": "fleet"}
    revoked = refused_request(setup, sign(setup.private_key, revoked_claims, expires_in=600))
    assert (revoked["key_id"], revoked["tenant"]) == ("signed-revoked", "fleet")
    forged = sign(generate_keypair("ed25519")[0], claims, expires_in=600)  # another signer
    anonymous = refused_request(setup, forged)
    assert anonymous["key_id"] == "anonymous" and "bad signature" in anonymous["message"]


def test_the_verifier_names_the_key_only_after_the_signature(tmp_path: Path):
    private, public = generate_keypair("ed25519")
    (tmp_path / "op.pub").write_bytes(public)
    (tmp_path / "revoked").write_text("k-revoked\n")
    v = SignedKeyVerifier(tmp_path / "op.pub", revoked_file=tmp_path / "revoked")
    claims = {"sub": "k", "tenant": "t"}
    named = {
        "expired": sign(private, claims, expires_in=-600),
        "not yet valid": sign(private, {**claims, "nbf": int(time.time()) + 600}, expires_in=900),
        "revoked": sign(private, {**claims, "sub": "k-revoked"}, expires_in=60),
        "no expiry": sign(private, claims, expires_in=None),
        "audience": sign(private, claims, expires_in=60, audience="elsewhere"),
        "claims": signed_unchecked(private, {**claims, "priority": "urgent"}),
    }
    for what, token in named.items():
        for _ in range(2):  # a refusal remembered keeps the name
            with pytest.raises(AuthenticationError) as refused:
                v.verify(token)
            sub = "k-revoked" if what == "revoked" else "k"
            assert refused.value.key == KeyRef(sub, "t"), what
    no_tenant = signed_unchecked(private, {"sub": "k"})
    with pytest.raises(AuthenticationError, match="tenant") as refused:
        v.verify(no_tenant)
    assert refused.value.key == KeyRef("k", None)
    forged = sign(generate_keypair("ed25519")[0], claims, expires_in=60)
    for token in (forged, "abc.def.ghi", "zh-not-a-jwt"):
        with pytest.raises(AuthenticationError) as refused:
            v.verify(token)
        assert refused.value.key is None


def signed_unchecked(private: bytes, claims: dict) -> str:
    """A token signed with claims `sign` would refuse to sign (the verifier refuses them)."""
    payload = {"aud": "zerohop", "exp": int(time.time()) + 60, **claims}
    return jwt.encode(payload, private, algorithm="EdDSA")


# -- the admin API -----------------------------------------------------------------------------


def admin_refusal(setup: Setup, seq: int, path: str) -> dict:
    record = setup.record_after(seq, lambda r: r.get("surface") == "admin" and r["path"] == path)
    assert "kind" not in record  # a request record, as the data plane's
    assert record["client"].startswith("127.0.0.1:")
    assert record["decision"] == record["error_type"]
    return record


@pytest.mark.parametrize(
    ("who", "status", "key", "decision"),
    [
        (None, 401, None, "authentication"),
        ("unknown", 401, None, "authentication"),
        ("revoked_admin", 401, ("revoked_admin", "ops"), "authentication"),
        ("data", 403, ("data", "acme"), "permission"),
    ],
)
def test_refused_admin_api_calls_are_audited(setup: Setup, who, status, key, decision):
    secret = UNKNOWN if who == "unknown" else setup.secrets.get(who or "")
    path = f"/v1/admin/tenants/t-{who}"  # one path per case: its record is told apart
    seq = setup.last_seq()
    headers = {} if secret is None else {"x-api-key": secret}
    answer = httpx.get(setup.server.url + path, headers=headers, timeout=SAFETY_TIMEOUT)
    assert answer.status_code == status, answer.text
    record = admin_refusal(setup, seq, path)
    assert (record["status"], record["decision"], record["method"]) == (status, decision, "GET")
    if key is None:
        assert (record["key_id"], record["tenant"]) == ("anonymous", "anonymous")
    else:
        assert (record["key_id"], record["tenant"]) == (setup.ids[key[0]], key[1])
    if who == "revoked_admin":  # the client is told what it was told before
        assert answer.json()["error"]["message"] == "invalid API key (unknown or revoked)"


def test_the_audit_search_finds_the_refusals_of_a_key(setup: Setup):
    refused_request(setup, setup.secrets["revoked"])
    admin = {"x-api-key": setup.secrets["admin"]}
    query = {"api_key_id": setup.ids["revoked"], "status": "4xx", "kind": "request"}
    found = httpx.get(
        setup.server.url + "/v1/admin/audit", params=query, headers=admin, timeout=SAFETY_TIMEOUT
    )
    assert found.status_code == 200, found.text
    records = found.json()["data"]
    assert records and {r["key_id"] for r in records} == {setup.ids["revoked"]}
    path = "/v1/admin/tenants/searched"
    data = {"x-api-key": setup.secrets["data"]}
    assert httpx.get(setup.server.url + path, headers=data).status_code == 403
    data_key = {"api_key_id": setup.ids["data"], "status": "403"}

    def admin_refusals() -> list[dict]:
        url = setup.server.url + "/v1/admin/audit"
        page = httpx.get(url, params=data_key, headers=admin, timeout=SAFETY_TIMEOUT)
        return [r for r in page.json()["data"] if r.get("path") == path]

    deadline = time.monotonic() + SAFETY_TIMEOUT
    while not admin_refusals():
        assert time.monotonic() < deadline, "the search never found the admin refusal"
        time.sleep(0.05)


# -- the console (and the admin API through a console session) ---------------------------------


def console(setup: Setup) -> httpx.Client:
    return httpx.Client(base_url=setup.server.url, follow_redirects=False, timeout=SAFETY_TIMEOUT)


def console_refusal(setup: Setup, seq: int, path: str, method: str = "POST") -> dict:
    def match(r: dict) -> bool:
        return r.get("surface") == "console" and r["path"] == path and r["method"] == method

    record = setup.record_after(seq, match)
    assert record["client"].startswith("127.0.0.1:") and record["decision"] == record["error_type"]
    return record


def log_in(setup: Setup) -> tuple[dict[str, str], str]:
    """A console session of the admin key: (its Cookie header, its CSRF token)."""
    with console(setup) as client:
        answer = client.post("/console/login", data={"key": setup.secrets["admin"]})
        assert answer.status_code == 303, answer.text
        cookie = re.match(rf"{COOKIE}=([^;]+);", answer.headers["set-cookie"])
        assert cookie, answer.headers
        headers = {"cookie": f"{COOKIE}={cookie.group(1)}"}
        page = client.get("/console/overview", headers=headers)
    token = re.search(r'<meta name="csrf-token" content="([^"]+)">', page.text)
    assert page.status_code == 200 and token, page.text
    return headers, token.group(1)


@pytest.mark.parametrize(
    ("who", "status", "key", "decision"),
    [
        ("unknown", 401, None, "authentication"),
        ("revoked_admin", 401, ("revoked_admin", "ops"), "authentication"),
        ("data", 403, ("data", "acme"), "permission"),
    ],
)
def test_a_refused_console_login_is_audited(setup: Setup, who, status, key, decision):
    secret = UNKNOWN if who == "unknown" else setup.secrets[who]
    seq = setup.last_seq()
    with console(setup) as client:
        answer = client.post("/console/login", data={"key": secret})
    assert answer.status_code == status and "set-cookie" not in answer.headers
    record = console_refusal(setup, seq, "/console/login")
    assert (record["status"], record["decision"]) == (status, decision)
    named = ("anonymous", "anonymous") if key is None else (setup.ids[key[0]], key[1])
    assert (record["key_id"], record["tenant"]) == named


def test_a_signed_key_at_the_console_login_is_named(setup: Setup):
    claims = {"sub": "signed-admin", "tenant": "ops", "admin": True}
    seq = setup.last_seq()
    with console(setup) as client:
        answer = client.post("/console/login", data={"key": sign(setup.private_key, claims,
                                                                 expires_in=600)})  # fmt: skip
    assert answer.status_code == 403
    record = console_refusal(setup, seq, "/console/login")
    assert (record["key_id"], record["tenant"], record["decision"]) == (
        "signed-admin", "ops", "permission"
    )  # fmt: skip


def test_a_console_post_with_a_bad_csrf_token_is_audited_with_the_sessions_key(setup: Setup):
    cookie, token = log_in(setup)
    seq = setup.last_seq()
    with console(setup) as client:
        logout = client.post("/console/logout", headers={**cookie, "x-csrf-token": "wrong"})
        assert logout.status_code == 403
        change = client.put(
            "/v1/admin/tenants/csrf-test",
            json={"weight": 2},
            headers=cookie,  # no token
        )
        assert change.status_code == 403
        assert change.json()["error"]["message"] == "missing or wrong CSRF token"
    record = console_refusal(setup, seq, "/console/logout")
    assert (record["status"], record["decision"]) == (403, "csrf")
    assert (record["key_id"], record["tenant"]) == (setup.ids["admin"], "ops")
    api = admin_refusal(setup, seq, "/v1/admin/tenants/csrf-test")
    assert (api["status"], api["decision"], api["key_id"]) == (403, "csrf", setup.ids["admin"])
    everything = b"".join(path.read_bytes() for path in log_files(setup.audit_dir))
    assert token.encode() not in everything and cookie["cookie"].split("=")[1].encode() not in (
        everything
    )  # fmt: skip


def test_cross_site_posts_are_audited(setup: Setup):
    cookie, token = log_in(setup)
    seq = setup.last_seq()
    other_site = {"sec-fetch-site": "cross-site", "origin": "https://evil.example"}
    with console(setup) as client:
        login = client.post(
            "/console/login", data={"key": setup.secrets["admin"]}, headers=other_site
        )
        assert login.status_code == 403 and "set-cookie" not in login.headers
        change = client.put(
            "/v1/admin/tenants/cross-site", json={"weight": 2},
            headers={**cookie, "x-csrf-token": token, **other_site},
        )  # fmt: skip
        assert change.status_code == 403
        assert change.json()["error"]["message"] == "a cross-site request is refused"
    record = console_refusal(setup, seq, "/console/login")
    assert (record["status"], record["decision"], record["key_id"]) == (
        403, "cross_site", "anonymous"
    )  # fmt: skip
    api = admin_refusal(setup, seq, "/v1/admin/tenants/cross-site")
    assert (api["status"], api["decision"]) == (403, "cross_site")
    assert (api["key_id"], api["tenant"]) == (setup.ids["admin"], "ops")


def test_a_dead_session_is_audited(setup: Setup):
    cookie, token = log_in(setup)
    with console(setup) as client:
        out = client.post("/console/logout", headers={**cookie, "x-csrf-token": token})
        assert out.status_code == 303
        seq = setup.last_seq()
        page = client.get("/console/usage", headers=cookie)
        assert page.status_code == 303 and page.headers["location"] == "/console/login"
        api = client.get("/v1/admin/tenants/dead-session", headers=cookie)
        assert api.status_code == 401
        assert api.json()["error"]["message"] == "this route needs an admin key"
        fresh = client.get("/console/tenants")  # no cookie: a first visit, not a refusal
        assert fresh.status_code == 303
        after = client.post("/console/login", data={"key": UNKNOWN})  # audited after it
        assert after.status_code == 401
    record = console_refusal(setup, seq, "/console/usage", "GET")
    assert (record["status"], record["decision"], record["key_id"]) == (303, "session", "anonymous")
    assert admin_refusal(setup, seq, "/v1/admin/tenants/dead-session")["decision"] == "session"
    console_refusal(setup, seq, "/console/login")  # records are written in order: so would it be
    first_visit = [
        r for r in setup.records() if r["seq"] > seq and r.get("path") == "/console/tenants"
    ]
    assert first_visit == []
