"""Issue 19, failures 1, 2 and 7 on the configuration side: every configured value is checked
where it enters, and no value that got into the store can take the replica down.

Real parts only: `zerohop` CLI subprocesses, a real SQLite key store (rows broken by hand
with sqlite3, as an older version or an operator could leave them), a live `zerohop serve`
(tests/live_server.py) and the official anthropic and openai SDKs and grpcio as clients.

- The CLIs (`keys create|update|tenant|sign`, `serve`) refuse a bad value with exit 2 and one
  line naming the flag, no traceback (failure 1: `keys tenant neg --weight -1` was taken).
- A limit of 0 allows nothing: 429 on both surfaces and RESOURCE_EXHAUSTED on gRPC, with the
  rate-limit headers, no retry-after and `x-should-retry: false` (failure 2: a 500 from a
  ZeroDivisionError), through a key's and a tenant's limits and a signed key's claims.
- A store row holding an invalid value refuses that key with 403 naming the field, logs the
  row, and serves every other key; the CLI repairs it.
- A signed key without `exp` is refused (401) unless the server allows it (failure 7).
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import anthropic
import grpc
import httpx
import openai
import pytest

from tests.live_server import MODEL_NAME, LiveServer
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2 as pb
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2_grpc as pb_grpc

CHAT = [{"role": "user", "content": "Hello"}]


def zerohop(*argv: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`zerohop ARGV` as a subprocess (the installed entry point's module); never raises."""
    return subprocess.run(
        [sys.executable, "-m", "zerohop", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def ok(*argv: str | Path) -> str:
    done = zerohop(*argv)
    assert done.returncode == 0, (argv, done.stderr)
    return done.stdout


def assert_usage_error(done: subprocess.CompletedProcess, flag: str) -> None:
    """Exit 2 and one line on stderr naming the flag; no traceback, nothing on stdout."""
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"argument {flag}:" in lines[0], lines[0]


def poll(check: Callable[[], bool], timeout: float = 5.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# -- the command lines ------------------------------------------------------------------------

KEYS_REFUSALS = [
    (["create", "--tenant", "t", "--rpm", "-1"], "--rpm"),
    (["create", "--tenant", "t", "--itpm=-5"], "--itpm"),
    (["create", "--tenant", "t", "--otpm", "many"], "--otpm"),
    (["create", "--tenant", "t", "--max-concurrency", "1.5"], "--max-concurrency"),
    (["create", "--tenant", "t", "--budget", "0"], "--budget"),
    (["create", "--tenant", "t", "--budget", "-5/day"], "--budget"),
    (["create", "--tenant", "t", "--budget", "5/week"], "--budget"),
    (["create", "--tenant", "t", "--priority", "urgent"], "--priority"),
    (["tenant", "neg", "--weight", "-1"], "--weight"),
    (["tenant", "neg", "--weight", "0"], "--weight"),
    (["tenant", "neg", "--weight", "nan"], "--weight"),
    (["tenant", "neg", "--weight", "inf"], "--weight"),
    (["tenant", "neg", "--weight", "heavy"], "--weight"),
    (["tenant", "neg", "--rpm", "-1"], "--rpm"),
    (["tenant", "neg", "--budget", "0/month"], "--budget"),
    (["update", "zh-whatever", "--otpm", "-3"], "--otpm"),
    (["update", "zh-whatever", "--budget", "0"], "--budget"),
]


@pytest.mark.parametrize("argv, flag", KEYS_REFUSALS, ids=[" ".join(a) for a, _ in KEYS_REFUSALS])
def test_keys_cli_refuses_a_bad_value_in_one_line_naming_the_flag(tmp_path, argv, flag):
    db = tmp_path / "keys.db"
    assert_usage_error(zerohop("keys", *argv, "--keys-db", db), flag)
    if db.exists():  # nothing was written
        with sqlite3.connect(db) as conn:
            assert conn.execute("SELECT count(*) FROM tenants").fetchone() == (0,)


def test_keys_cli_takes_zero_limits_and_a_positive_weight(tmp_path):
    db = tmp_path / "keys.db"
    made = json.loads(
        ok("keys", "create", "--tenant", "z", "--rpm", "0", "--keys-db", db, "--json")
    )
    assert made["limits"]["rpm"] == 0
    row = json.loads(
        ok("keys", "tenant", "z", "--weight", "0.25", "--itpm", "0", "--keys-db", db, "--json")
    )
    assert row["weight"] == 0.25 and row["itpm"] == 0


SIGN_REFUSALS = [
    (["--tenant-weight", "0"], "--tenant-weight"),
    (["--tenant-weight", "-inf"], "--tenant-weight"),
    (["--rpm", "-1"], "--rpm"),
    (["--tenant-otpm", "-1"], "--tenant-otpm"),
    (["--budget", "0"], "--budget"),
    (["--tenant-budget", "0/day"], "--tenant-budget"),
]


@pytest.mark.parametrize("extra, flag", SIGN_REFUSALS, ids=[" ".join(a) for a, _ in SIGN_REFUSALS])
def test_keys_sign_refuses_a_bad_value(tmp_path, extra, flag):
    argv = ["keys", "sign", "--private-key", tmp_path / "none.pem", "--key-id", "k"]
    done = zerohop(*argv, "--tenant", "t", "--expires", "1h", *extra)
    assert_usage_error(done, flag)


def test_keys_sign_needs_an_expiry_unless_told(tmp_path):
    private = tmp_path / "op.key"
    ok("keys", "keygen", "--out-private", private, "--out-public", tmp_path / "op.pub")
    argv = ["keys", "sign", "--private-key", private, "--key-id", "k", "--tenant", "t"]
    done = zerohop(*argv)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().count("\n") == 0
    assert "one of the arguments --expires --no-expiry is required" in done.stderr
    never = zerohop(*argv, "--no-expiry")
    assert never.returncode == 0 and "never expires" in never.stderr
    assert "exp" not in _claims(never.stdout.strip())
    assert "exp" in _claims(ok(*argv, "--expires", "1h").strip())


def _claims(token: str) -> dict:
    import jwt

    return jwt.decode(token, options={"verify_signature": False})


SERVE_REFUSALS = [
    ("--max-num-seqs", "0"),
    ("--max-num-batched-tokens", "-1"),
    ("--block-size", "0"),
    ("--kv-cache-memory", "0"),
    ("--num-threads", "0"),
    ("--max-model-len", "0"),
    ("--num-kv-blocks", "-4"),
    ("--port", "-1"),
    ("--port", "65536"),
    ("--max-body-bytes", "0"),
    ("--drain-seconds", "-1"),
    ("--drain-seconds", "nan"),
    ("--max-queue-wait", "-0.5"),
    ("--max-waiting", "-1"),
    ("--max-connections", "0"),
    ("--max-connections-per-address", "0"),
    ("--header-timeout", "0"),
    ("--body-timeout", "-1"),
    ("--body-min-rate", "0"),
    ("--keep-alive-timeout", "inf"),
    ("--max-header-bytes", "0"),
    ("--http2-max-streams", "129"),
    ("--grpc-max-concurrent-streams", "0"),
    ("--audit-max-bytes", "0"),
    ("--batch-max-share", "0"),
    ("--batch-max-share", "1.5"),
]


@pytest.mark.parametrize("flag, value", SERVE_REFUSALS, ids=[" ".join(f) for f in SERVE_REFUSALS])
def test_serve_refuses_a_bad_numeric_flag_in_one_line(tmp_path, flag, value):
    done = zerohop("serve", "tiny", f"{flag}={value}", env={"XDG_DATA_HOME": str(tmp_path)})
    assert_usage_error(done, flag)


# -- a live server: limits of 0, rows broken by hand, signed keys --------------------------------

# name: (tenant, `keys create` flags)
KEYS = {
    "ok": ("ok", []),
    "rpm0": ("rpm0", ["--rpm", "0"]),
    "itpm0": ("itpm0", ["--itpm", "0"]),
    "otpm0": ("otpm0", ["--otpm", "0"]),
    "conc0": ("conc0", ["--max-concurrency", "0"]),
    "tenant_rpm0": ("tenant_rpm0", []),
    "bad_rpm": ("bad_rpm", ["--rpm", "10", "--itpm", "5000"]),
    "neg_weight": ("neg", []),
    "zero_weight": ("zero", []),
    "bad_priority": ("bad_priority", []),
    "old_budget": ("old_budget", ["--budget", "100"]),
    "bad_models": ("bad_models", []),
    "live_broken": ("live_broken", []),
    "repair_rpm": ("repair_rpm", ["--rpm", "10", "--itpm", "5000"]),
    "repair_weight": ("repair_neg", []),
}
# What an older version or an operator with sqlite3 left in the store.
BROKEN_BY_HAND = {
    "bad_rpm": "UPDATE keys SET rpm = -1 WHERE key_id = ?",
    "bad_priority": "UPDATE keys SET priority = 'urgent' WHERE key_id = ?",
    "old_budget": "UPDATE keys SET budget_tokens = 0 WHERE key_id = ?",
    "bad_models": "UPDATE keys SET models = 'tiny-llama' WHERE key_id = ?",
    "repair_rpm": "UPDATE keys SET rpm = -1 WHERE key_id = ?",
}
BROKEN_TENANTS = {"neg": -1.0, "zero": 0.0, "repair_neg": -1.0}
# The field each broken key's 403 names.
BROKEN_FIELDS = {
    "bad_rpm": "keys.rpm",
    "neg_weight": "tenants.weight",
    "zero_weight": "tenants.weight",
    "bad_priority": "keys.priority",
    "old_budget": "keys.budget_tokens",
    "bad_models": "keys.models",
}


@dataclass
class Served:
    server: LiveServer
    db: Path
    keys: dict[str, dict]
    tokens: dict[str, str]

    def secret(self, name: str) -> str:
        return self.tokens[name] if name in self.tokens else self.keys[name]["key"]

    def post(self, path: str, name: str, **body) -> httpx.Response:
        body = {"model": MODEL_NAME, "max_tokens": 2, "messages": CHAT, **body}
        headers = {"x-api-key": self.secret(name)}
        return httpx.post(self.server.url + path, json=body, headers=headers, timeout=60)

    def anthropic(self, name: str, seen: list) -> anthropic.Anthropic:
        hooks = {"request": [seen.append]}
        return anthropic.Anthropic(
            base_url=self.server.url,
            api_key=self.secret(name),
            max_retries=2,
            http_client=anthropic.DefaultHttpxClient(event_hooks=hooks, timeout=60),
        )

    def openai(self, name: str, seen: list) -> openai.OpenAI:
        hooks = {"request": [seen.append]}
        return openai.OpenAI(
            base_url=self.server.url + "/v1",
            api_key=self.secret(name),
            max_retries=2,
            http_client=openai.DefaultHttpxClient(event_hooks=hooks, timeout=60),
        )

    def grpc_generate(self, name: str) -> grpc.RpcError | None:
        request = pb.GenerateRequest(model=MODEL_NAME, prompt="Hello", max_tokens=2)
        with grpc.insecure_channel(f"127.0.0.1:{self.server.grpc_port}") as channel:
            stub = pb_grpc.ZerohopStub(channel)
            try:
                list(
                    stub.Generate(request, metadata=(("x-api-key", self.secret(name)),), timeout=60)
                )
            except grpc.RpcError as exc:
                return exc
        return None


def _break_rows(db: Path, keys: dict[str, dict]) -> None:
    with sqlite3.connect(db) as conn:
        for name, sql in BROKEN_BY_HAND.items():
            assert conn.execute(sql, (keys[name]["key_id"],)).rowcount == 1
        for tenant, weight in BROKEN_TENANTS.items():
            conn.execute("UPDATE tenants SET weight = ? WHERE name = ?", (weight, tenant))


def _sign(private: Path, key_id: str, *flags: str) -> str:
    argv = ["keys", "sign", "--private-key", private, "--key-id", key_id, "--tenant", key_id]
    return ok(*argv, *flags).strip()


@pytest.fixture(scope="module")
def served(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("config_validation")
    db = root / "keys.db"
    ok("keys", "tenant", "tenant_rpm0", "--rpm", "0", "--keys-db", db)
    keys = {}
    for name, (tenant, flags) in KEYS.items():
        out = ok("keys", "create", "--tenant", tenant, *flags, "--keys-db", db, "--json")
        keys[name] = json.loads(out)
    _break_rows(db, keys)
    private, public = root / "op.key", root / "op.pub"
    ok("keys", "keygen", "--out-private", private, "--out-public", public)
    tokens = {
        "signed_ok": _sign(private, "signed-ok", "--expires", "1h"),
        "signed_rpm0": _sign(private, "signed-rpm0", "--rpm", "0", "--expires", "1h"),
        "signed_tenant_otpm0": _sign(private, "signed-t0", "--tenant-otpm", "0", "--expires", "1h"),
        "signed_forever": _sign(private, "signed-forever", "--no-expiry"),
    }
    args = [
        "--keys-db",
        str(db),
        "--audit-dir",
        str(root / "audit"),
        "--jwt-public-key",
        str(public),
    ]
    server = LiveServer(llama_dir, args).start(root / "server.log")
    yield Served(server, db, keys, tokens)
    server.stop()


ZERO_LIMITS = [
    ("rpm0", "rate_limit_requests", "rpm limit is 0"),
    ("itpm0", "rate_limit_input_tokens", "itpm limit is 0"),
    ("otpm0", "rate_limit_output_tokens", "otpm limit is 0"),
    ("conc0", "concurrency", "max_concurrency limit is 0"),
    ("tenant_rpm0", "rate_limit_requests", "tenant:tenant_rpm0: its rpm limit is 0"),
    ("signed_rpm0", "rate_limit_requests", "key:signed-rpm0: its rpm limit is 0"),
    ("signed_tenant_otpm0", "rate_limit_output_tokens", "tenant:signed-t0: its otpm limit is 0"),
]


def _no_retry(headers: Mapping[str, str]) -> None:
    assert "retry-after" not in headers and "retry-after-ms" not in headers, headers
    assert headers["x-should-retry"] == "false"


@pytest.mark.parametrize("name, reason, message", ZERO_LIMITS, ids=[z[0] for z in ZERO_LIMITS])
def test_a_limit_of_zero_is_429_on_both_sdks_never_retried(served, name, reason, message):
    seen: list = []
    with pytest.raises(anthropic.RateLimitError) as caught:
        served.anthropic(name, seen).messages.create(model=MODEL_NAME, max_tokens=2, messages=CHAT)
    error = caught.value
    assert error.status_code == 429 and message in error.message
    assert error.body["error"]["type"] == "rate_limit_error"
    _no_retry(error.response.headers)
    assert len(seen) == 1  # x-should-retry: false: the SDK did not retry
    with pytest.raises(openai.RateLimitError) as caught_openai:
        served.openai(name, seen).chat.completions.create(
            model=MODEL_NAME, max_tokens=2, messages=CHAT
        )
    error = caught_openai.value
    assert error.status_code == 429 and message in error.message
    assert error.code == "rate_limit_exceeded"
    _no_retry(error.response.headers)
    assert len(seen) == 2


def test_a_limit_of_zero_keeps_the_rate_limit_headers(served):
    anthropic_reply = served.post("/v1/messages", "rpm0")
    assert anthropic_reply.status_code == 429
    h = anthropic_reply.headers
    assert h["anthropic-ratelimit-requests-limit"] == "0"
    assert h["anthropic-ratelimit-requests-remaining"] == "0"
    assert "anthropic-ratelimit-requests-reset" in h
    openai_reply = served.post("/v1/chat/completions", "rpm0")
    assert openai_reply.status_code == 429
    h = openai_reply.headers
    assert h["x-ratelimit-limit-requests"] == "0" and h["x-ratelimit-remaining-requests"] == "0"
    assert h["x-ratelimit-reset-requests"] == "0ms"


@pytest.mark.parametrize("name", ["rpm0", "tenant_rpm0", "signed_rpm0", "conc0"])
def test_a_limit_of_zero_is_resource_exhausted_on_grpc(served, name):
    error = served.grpc_generate(name)
    assert error is not None and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit is 0" in error.details()
    trailers = dict(error.trailing_metadata())
    assert "retry-after" not in trailers and trailers["x-should-retry"] == "false"


def test_keys_beside_the_zero_limits_are_served(served):
    for name in ("ok", "signed_ok"):
        seen: list = []
        reply = served.anthropic(name, seen).messages.create(
            model=MODEL_NAME, max_tokens=2, messages=CHAT
        )
        assert reply.usage.output_tokens >= 1
        assert served.grpc_generate(name) is None


@pytest.mark.parametrize("name, field", BROKEN_FIELDS.items(), ids=list(BROKEN_FIELDS))
def test_a_row_broken_by_hand_refuses_that_key_with_403_naming_the_field(served, name, field):
    seen: list = []
    with pytest.raises(anthropic.PermissionDeniedError) as caught:
        served.anthropic(name, seen).messages.create(model=MODEL_NAME, max_tokens=2, messages=CHAT)
    error = caught.value
    assert error.body["error"]["type"] == "permission_error"
    assert "this key's configuration is invalid" in error.message and field in error.message
    assert len(seen) == 1
    with pytest.raises(openai.PermissionDeniedError) as caught_openai:
        served.openai(name, seen).chat.completions.create(
            model=MODEL_NAME, max_tokens=2, messages=CHAT
        )
    assert caught_openai.value.code == "invalid_key_configuration"
    assert field in caught_openai.value.message
    error = served.grpc_generate(name)
    assert error is not None and error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert field in error.details()
    # The log names the row and the field, once per load of the store.
    key_id = served.keys[name]["key_id"]
    lines = [line for line in served.server.log().splitlines() if key_id in line]
    assert any("is refused (403)" in line and field in line for line in lines), lines


def test_broken_rows_do_not_take_the_replica_down(served):
    # Failure 1: a weight of -1 killed the engine process, and every tenant got 529 after.
    for name in BROKEN_FIELDS:
        assert served.post("/v1/messages", name).status_code == 403
    for path in ("/v1/messages", "/v1/chat/completions"):
        assert served.post(path, "ok").status_code == 200
    assert httpx.get(served.server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(served.server.url + "/ready", timeout=10).status_code == 200
    assert "Traceback" not in served.server.log()


def test_keys_list_shows_a_broken_row_and_the_cli_repairs_it(served):
    db, key = served.db, served.keys["repair_rpm"]
    shown = json.loads(ok("keys", "show", key["key_id"], "--keys-db", db, "--json"))[0]
    assert shown["problems"] == [
        f"keys.rpm of key {key['key_id']!r} must be an integer >= 0, not -1"
    ]
    assert shown["limits"]["itpm"] == 5000  # the good fields are read as they are
    assert "invalid: keys.rpm" in ok("keys", "list", "--keys-db", db)
    # Updating another limit would write the placeholder back: refused, the flag named.
    done = zerohop("keys", "update", key["key_id"], "--otpm", "100", "--keys-db", db)
    assert done.returncode == 1 and "give --rpm too" in done.stderr
    assert done.stderr.strip().count("\n") == 0 and "Traceback" not in done.stderr
    done = zerohop("keys", "tenant", "repair_neg", "--rpm", "100", "--keys-db", db)
    assert done.returncode == 1 and "give --weight too" in done.stderr
    # Repaired: served within a reload (half a second).
    ok("keys", "update", key["key_id"], "--rpm", "10", "--keys-db", db)
    ok("keys", "tenant", "repair_neg", "--weight", "2", "--keys-db", db)
    fixed = json.loads(ok("keys", "show", key["key_id"], "--keys-db", db, "--json"))[0]
    assert "problems" not in fixed and fixed["limits"] == {
        "rpm": 10, "itpm": 5000, "otpm": None, "max_concurrency": None
    }  # fmt: skip
    for name in ("repair_rpm", "repair_weight"):
        assert poll(lambda n=name: served.post("/v1/messages", n).status_code == 200)


def test_a_row_broken_while_serving_is_refused_and_the_rest_served(served):
    key_id = served.keys["live_broken"]["key_id"]
    assert served.post("/v1/messages", "live_broken").status_code == 200
    with sqlite3.connect(served.db) as conn:  # by hand, bumping the version as the CLI does
        conn.execute("UPDATE keys SET max_concurrency = 'two' WHERE key_id = ?", (key_id,))
        conn.execute("UPDATE meta SET value = value + 1 WHERE name = 'keys_version'")
    assert poll(lambda: served.post("/v1/messages", "live_broken").status_code == 403)
    assert "keys.max_concurrency" in served.post("/v1/messages", "live_broken").text
    assert served.post("/v1/messages", "ok").status_code == 200
    assert httpx.get(served.server.url + "/health", timeout=10).status_code == 200


def test_a_signed_key_without_exp_is_refused(served):
    # Failure 7: it was accepted and never expired. (A server started with
    # --allow-nonexpiring-signed-keys takes it: tests/test_gateway_auth.py, "forever".)
    seen: list = []
    with pytest.raises(anthropic.AuthenticationError) as caught:
        served.anthropic("signed_forever", seen).messages.create(
            model=MODEL_NAME, max_tokens=2, messages=CHAT
        )
    assert "has no expiry (claim 'exp')" in caught.value.message
    with pytest.raises(openai.AuthenticationError):
        served.openai("signed_forever", seen).chat.completions.create(
            model=MODEL_NAME, max_tokens=2, messages=CHAT
        )
    error = served.grpc_generate("signed_forever")
    assert error is not None and error.code() == grpc.StatusCode.UNAUTHENTICATED
