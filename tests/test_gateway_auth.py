"""Keys on every door: API keys from the SQLite store, signed keys, open mode and the CLI.

Real `zerohop serve` subprocesses, the official SDKs, grpcio and a real SQLite store; no
mocks. `zerohop keys ...` runs in-process through `zerohop.cli.main` (the same argv
parsing and code as the console script) because a `python -m zerohop keys` subprocess costs
~3.5 s here (its `main` imports zerohop.app.server, hence torch); one test runs the real
entry point as a subprocess to cover that path too.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import anthropic
import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.live_server import MODEL_NAME, LiveServer
from zerohop.gateway.store.sqlite import hash_secret, new_key
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2 as pb
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
USER = [{"role": "user", "content": "hi"}]
# A request that succeeds with a good key, per (method, path) of the app's route table.
BODIES: dict[tuple[str, str], dict | None] = {
    ("POST", "/v1/messages"): {
        "model": MODEL_NAME, "max_tokens": 2, "temperature": 0, "messages": USER
    },
    ("POST", "/v1/messages/count_tokens"): {"model": MODEL_NAME, "messages": USER},
    ("POST", "/v1/chat/completions"): {
        "model": MODEL_NAME, "max_tokens": 2, "temperature": 0, "messages": USER
    },
    ("POST", "/v1/completions"): {
        "model": MODEL_NAME, "max_tokens": 2, "temperature": 0, "prompt": "hi"
    },
    ("GET", "/v1/models"): None,
    ("GET", "/v1/models/{model_id}"): None,
    ("POST", "/v1/responses"): {"model": MODEL_NAME, "max_output_tokens": 2, "input": "hi"},
    ("POST", "/v1/responses/input_tokens"): {"model": MODEL_NAME, "input": "hi"},
    ("POST", "/v1/responses/compact"): {"model": MODEL_NAME, "input": "hi"},
    ("GET", "/v1/responses/{response_id}"): None,
    ("DELETE", "/v1/responses/{response_id}"): None,
    ("GET", "/v1/responses/{response_id}/input_items"): None,
    ("POST", "/v1/responses/{response_id}/cancel"): None,
}  # fmt: skip
PATH_PARAMS = {"{model_id}": MODEL_NAME}  # what a templated route's path is called with
# A stored-response route is called with a fresh response of this key's tenant (its own
# key may not be able to make one): the background kind, which every route takes.
RESPONSE_OWNER: dict[str, str] = {}
OPEN_PATHS = ("/health", "/ready", "/metrics")
SAFETY_TIMEOUT = 60.0  # seconds waited for a change to go live (the server polls every 0.5 s)


# -- helpers ------------------------------------------------------------------------------------


def cli(*argv: str | Path) -> str:
    """`zerohop ARGV` in-process; its stdout (exit status 0 asserted)."""
    from zerohop.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in argv])
    assert rc == 0, f"zerohop {' '.join(map(str, argv))}: exit {rc}\n{err.getvalue()}"
    return out.getvalue()


def cli_json(*argv: str | Path):
    return json.loads(cli(*argv, "--json"))


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def headers_for(key: str | None, style: str = "x-api-key") -> dict[str, str]:
    if key is None:
        return {}
    return {"x-api-key": key} if style == "x-api-key" else {"authorization": f"Bearer {key}"}


def http_call(
    client: httpx.Client, route: tuple[str, str], key: str | None, style: str = "x-api-key"
) -> httpx.Response:
    method, path = route
    body = BODIES[route]
    for param, value in PATH_PARAMS.items():
        path = path.replace(param, value)
    if "{response_id}" in path:
        path = path.replace("{response_id}", new_response(client, RESPONSE_OWNER["key"]))
    return client.request(method, path, json=body, headers=headers_for(key, style))


def new_response(client: httpx.Client, key: str) -> str:
    body = {**BODIES[("POST", "/v1/responses")], "background": True}  # type: ignore[dict-item]
    made = client.post("/v1/responses", json=body, headers=headers_for(key))
    assert made.status_code == 200, made.text
    return made.json()["id"]


def grpc_call(stub: pb_grpc.ZerohopStub, method, metadata) -> grpc.StatusCode:
    """Call one method of the service descriptor with a valid request; its status code."""
    request = getattr(pb, method.input_type.name)(model=MODEL_NAME, prompt="hi")
    if "max_tokens" in method.input_type.fields_by_name:
        request.max_tokens = 2
        request.temperature = 0.0
    rpc = getattr(stub, method.name)
    try:
        if method.server_streaming:
            list(rpc(request, metadata=metadata, timeout=30))
        else:
            rpc(request, metadata=metadata, timeout=30)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def grpc_metadata(key: str | None, style: str = "x-api-key") -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers_for(key, style).items()]


GRPC_METHODS = list(pb.DESCRIPTOR.services_by_name["Zerohop"].methods)


def poll(check: Callable[[], bool], timeout: float = SAFETY_TIMEOUT) -> None:
    """Wait until `check()` holds (polled every 50 ms). The timeout is a safety net for a
    change that never goes live, not a bound under test."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"still not so after the {timeout} s safety timeout"
        time.sleep(0.05)


def secret_free(text: str | bytes, secrets: list[str]) -> list[str]:
    data = text.encode() if isinstance(text, str) else text
    return [s[:11] for s in secrets if s.encode() in data]


def db_bytes(db: Path) -> bytes:
    """The store's bytes, WAL and shared memory included (rows may sit in the WAL)."""
    return b"".join(p.read_bytes() for p in db.parent.glob(db.name + "*"))


# -- the keyed server ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A key store with keys in every state, made by the CLI before the server starts."""
    db = tmp_path_factory.mktemp("keys") / "keys.db"

    def create(*flags: str) -> dict:
        return cli_json("keys", "create", "--keys-db", db, *flags)

    made = {
        "valid": create("--tenant", "acme", "--name", "valid"),
        "sibling": create("--tenant", "acme", "--name", "sibling"),
        "revoked": create("--tenant", "acme", "--name", "revoked"),
        "expired": create("--tenant", "acme", "--name", "short", "--expires", "1s"),
        "expired_past": create("--tenant", "acme", "--expires", "2001-02-03T04:05:06Z"),
        "restricted": create("--tenant", "acme", "--models", "other-model"),
        "mutable": create("--tenant", "beta", "--name", "mutable"),
        "metered": create("--tenant", "metered", "--name", "metered"),
    }
    assert "revoked" in cli("keys", "revoke", made["revoked"]["key_id"], "--keys-db", db)
    assert made["expired"]["expires"] - made["expired"]["created"] == pytest.approx(1, abs=0.1)
    assert made["restricted"]["models"] == ["other-model"]
    RESPONSE_OWNER["key"] = made["valid"]["key"]
    return {"db": db, "keys": {name: rec["key"] for name, rec in made.items()}, "records": made}


@pytest.fixture(scope="module")
def server(llama_dir: Path, store: dict, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("keyed_server") / "server.log"
    srv = LiveServer(llama_dir, ["--keys-db", str(store["db"])]).start(log)
    # The 1 s key has expired by now (start-up takes longer), but wait until the server says so.
    expired = headers_for(store["keys"]["expired"])
    path = "/v1/messages/count_tokens"
    body = BODIES[("POST", path)]
    poll(lambda: httpx.post(srv.url + path, json=body, headers=expired).status_code == 401)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server: LiveServer):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def stub(server: LiveServer):
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        yield pb_grpc.ZerohopStub(channel)


@pytest.fixture(scope="module")
def routes(llama_dir: Path) -> list[tuple[str, str]]:
    """The app's own route table (what `zerohop serve` mounts), built in-process.

    create_app only needs a ServingContext to build its routes: a real one with the tiny
    model's real tokenizer and no engine (nothing here handles a request). Enumerating
    `create_app(ctx).routes` rather than a list in this file means a route added later is
    checked here too (and fails until BODIES says how to call it)."""
    from zerohop.api.serving.service import ServingContext
    from zerohop.app.routes import create_app
    from zerohop.engine.text.tokenizer import Tokenizer

    ctx = ServingContext(
        engine=None,  # type: ignore[arg-type]
        tokenizer=Tokenizer.from_dir(llama_dir),
        model_name=MODEL_NAME,
        max_model_len=2048,
    )
    table = sorted(create_app(ctx).routes)
    missing = [r for r in table if r not in BODIES]
    assert not missing, f"new routes: add a request body to BODIES for {missing}"
    assert len(table) >= 6, table
    return table


REFUSED = ("none", "wrong", "wrong_jwt", "revoked", "expired", "expired_past")


def refused_keys(store: dict) -> dict[str, str | None]:
    keys = store["keys"]
    return {
        "none": None,
        "wrong": new_key(),
        "wrong_jwt": "eyJhbGciOiJFZERTQSJ9.eyJzdWIiOiJ4In0.c2ln",
        "revoked": keys["revoked"],
        "expired": keys["expired"],
        "expired_past": keys["expired_past"],
    }


def test_every_route_refuses_missing_wrong_revoked_and_expired_keys(http, routes, store):
    failures = []
    secrets = list(store["keys"].values())
    for route in routes:
        for case, key in refused_keys(store).items():
            for style in ("x-api-key", "bearer") if key else ("x-api-key",):
                r = http_call(http, route, key, style)
                where = f"{route} {case} {style}: {r.status_code} {r.text[:200]}"
                body = r.json()
                if r.status_code != 401:
                    failures.append(where)
                elif is_anthropic(route[1]):
                    if body.get("type") != "error" or body["error"]["type"] != (
                        "authentication_error"
                    ):
                        failures.append(where)
                elif body["error"].get("code") != "invalid_api_key" or not isinstance(
                    body["error"].get("type"), str
                ):
                    failures.append(where)
                if secret_free(r.text, secrets):
                    failures.append(f"{where}: the error echoes a secret")
    assert not failures, "\n".join(failures)


def test_every_grpc_method_refuses_missing_wrong_revoked_and_expired_keys(stub, store):
    assert {m.name for m in GRPC_METHODS} >= {"Generate", "CountTokens"}
    failures = []
    for method in GRPC_METHODS:
        for case, key in refused_keys(store).items():
            for style in ("x-api-key", "bearer") if key else ("x-api-key",):
                code = grpc_call(stub, method, grpc_metadata(key, style))
                if code != grpc.StatusCode.UNAUTHENTICATED:
                    failures.append(f"{method.name} {case} {style}: {code}")
    assert not failures, "\n".join(failures)


def test_health_ready_and_metrics_stay_open(http, server):
    for path in OPEN_PATHS:
        r = http.get(path)
        assert r.status_code == 200, (path, r.status_code, r.text[:200])
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_valid_key_works_on_every_route_and_method(http, stub, routes, store):
    key = store["keys"]["valid"]
    failures = []
    for route in routes:
        for style in ("x-api-key", "bearer"):
            r = http_call(http, route, key, style)
            if r.status_code != 200:
                failures.append(f"{route} {style}: {r.status_code} {r.text[:200]}")
    models = http.get("/v1/models", headers=headers_for(key)).json()
    assert [m["id"] for m in models["data"]] == [MODEL_NAME]
    for method in GRPC_METHODS:
        for style in ("x-api-key", "bearer"):
            code = grpc_call(stub, method, grpc_metadata(key, style))
            if code != grpc.StatusCode.OK:
                failures.append(f"gRPC {method.name} {style}: {code}")
    assert not failures, "\n".join(failures)


def test_key_restricted_to_other_models_is_forbidden(http, stub, routes, store):
    key = store["keys"]["restricted"]
    failures = []
    for route in routes:
        r = http_call(http, route, key)
        if route == ("GET", "/v1/models"):
            if r.status_code != 200 or r.json()["data"] != []:
                failures.append(f"{route}: {r.status_code} {r.text[:200]}")
            continue
        body = r.json()
        if is_anthropic(route[1]) and body.get("type") != "error":
            failures.append(f"{route}: not the Anthropic error shape: {r.text[:200]}")
        if r.status_code != 403 or body["error"]["type"] != "permission_error":
            failures.append(f"{route}: {r.status_code} {r.text[:200]}")
    for method in GRPC_METHODS:
        code = grpc_call(stub, method, grpc_metadata(key))
        if code != grpc.StatusCode.PERMISSION_DENIED:
            failures.append(f"gRPC {method.name}: {code}")
    assert not failures, "\n".join(failures)


# -- the SDKs and both headers ------------------------------------------------------------------


def test_anthropic_sdk_with_api_key_and_auth_token(server, store):
    key = store["keys"]["valid"]
    # api_key= sends x-api-key; auth_token= sends Authorization: Bearer.
    for kwargs in ({"api_key": key}, {"api_key": None, "auth_token": key}):
        client = anthropic.Anthropic(base_url=server.url, max_retries=0, **kwargs)
        # anthropic 2.x has no sampling kwargs; the API still takes them in the body.
        message = client.messages.create(
            model=MODEL_NAME, max_tokens=2, messages=USER, extra_body={"temperature": 0}
        )
        assert message.usage.output_tokens >= 1
        count = client.messages.count_tokens(model=MODEL_NAME, messages=USER)
        assert count.input_tokens > 0
    for kwargs in ({"api_key": new_key()}, {"api_key": None, "auth_token": "nope"}):
        client = anthropic.Anthropic(base_url=server.url, max_retries=0, **kwargs)
        with pytest.raises(anthropic.AuthenticationError) as refused:
            client.messages.create(model=MODEL_NAME, max_tokens=2, messages=USER)
        assert refused.value.status_code == 401
        assert refused.value.body["error"]["type"] == "authentication_error"


def test_openai_sdk(server, store):
    key = store["keys"]["valid"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    chat = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=2, messages=USER, temperature=0
    )
    assert chat.usage.completion_tokens >= 1
    assert [m.id for m in client.models.list()] == [MODEL_NAME]
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key=new_key(), max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.chat.completions.create(model=MODEL_NAME, max_tokens=2, messages=USER)
    assert refused.value.status_code == 401
    assert refused.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_both_headers_on_both_surfaces(http, store):
    key = store["keys"]["valid"]
    for path in ("/v1/messages/count_tokens", "/v1/chat/completions"):
        route = ("POST", path)
        for headers in (
            {"x-api-key": key},
            {"authorization": f"Bearer {key}"},
            {"authorization": f"bearer {key}"},
        ):
            r = http.post(path, json=BODIES[route], headers=headers)
            assert r.status_code == 200, (path, headers.keys(), r.text[:200])
        for headers in (
            {"authorization": f"Basic {key}"},
            {"authorization": key},
            {"x-api-key": new_key(), "authorization": f"Bearer {key}"},  # x-api-key wins
        ):
            r = http.post(path, json=BODIES[route], headers=headers)
            assert r.status_code == 401, (path, headers, r.text[:200])


# -- live changes -------------------------------------------------------------------------------


def test_store_changes_are_live_without_restart(http, stub, store):
    db = store["db"]

    def status(key: str, path: str = "/v1/messages/count_tokens") -> int:
        return http.post(path, json=BODIES[("POST", path)], headers=headers_for(key)).status_code

    # A key created while the server runs.
    created = cli_json("keys", "create", "--tenant", "acme", "--name", "late", "--keys-db", db)
    poll(lambda: status(created["key"]) == 200)

    # The valid key's sibling, revoked while the server runs.
    sibling = store["keys"]["sibling"]
    assert status(sibling) == 200
    cli("keys", "revoke", store["records"]["sibling"]["key_id"], "--keys-db", db)
    poll(lambda: status(sibling) == 401)
    method = pb.DESCRIPTOR.services_by_name["Zerohop"].methods_by_name["CountTokens"]
    assert grpc_call(stub, method, grpc_metadata(sibling)) == grpc.StatusCode.UNAUTHENTICATED
    assert status(store["keys"]["valid"]) == 200  # the rest of the tenant is untouched

    # A key's models, changed and changed back.
    mutable, key_id = store["keys"]["mutable"], store["records"]["mutable"]["key_id"]
    assert status(mutable) == 200
    cli("keys", "update", key_id, "--models", "other-model", "--keys-db", db)
    poll(lambda: status(mutable) == 403)
    assert grpc_call(stub, method, grpc_metadata(mutable)) == grpc.StatusCode.PERMISSION_DENIED
    cli("keys", "update", key_id, "--models", "", "--keys-db", db)
    poll(lambda: status(mutable) == 200)


# -- open mode ----------------------------------------------------------------------------------


def serve_cmd(llama_dir: Path, *args: str | Path) -> list[str]:
    return [
        sys.executable, "-m", "zerohop", "serve", str(llama_dir),
        "--served-model-name", MODEL_NAME, "--num-threads", "1", "--num-kv-blocks", "64",
        *map(str, args),
    ]  # fmt: skip


def test_open_mode_on_loopback_without_keys(live_server: LiveServer):
    # The shared server of the API tests: its own empty data folder, so no keys at all.
    assert "no API keys configured: open to any client" in live_server.log()
    r = httpx.post(
        live_server.url + "/v1/messages/count_tokens",
        json=BODIES[("POST", "/v1/messages/count_tokens")],
    )
    assert r.status_code == 200, r.text
    assert httpx.get(live_server.url + "/v1/models").json()["data"][0]["id"] == MODEL_NAME


def test_no_keys_on_a_public_address_refuses_to_start_unless_allowed(llama_dir, tmp_path):
    empty = tmp_path / "empty" / "keys.db"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "XDG_DATA_HOME": str(tmp_path / "data")}
    port_file = tmp_path / "refusing.ports.json"  # written once it listens: never, here
    cmd = serve_cmd(
        llama_dir, "--host", "0.0.0.0", "--port", 0, "--grpc-port", "auto",
        "--port-file", port_file, "--keys-db", empty,
    )  # fmt: skip
    # The refusal and the --allow-anonymous start run side by side (each loads the model).
    refusing = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    args = ["--host", "0.0.0.0", "--keys-db", str(empty), "--allow-anonymous"]
    try:
        anonymous = LiveServer(llama_dir, args).start(tmp_path / "anonymous.log")
        try:
            assert httpx.get(anonymous.url + "/v1/models").status_code == 200
            assert "no API keys configured: open to any client" in anonymous.log()
        finally:
            assert anonymous.stop() == 0
        stdout, stderr = refusing.communicate(timeout=120)
    finally:
        if refusing.poll() is None:
            refusing.kill()
            refusing.wait()
    assert refusing.returncode == 1, stdout + stderr
    assert "serving" not in stdout
    lines = [line for line in stderr.splitlines() if "--allow-anonymous" in line]
    assert len(lines) == 1 and lines[0].startswith("zerohop: no API keys configured"), stderr
    assert not port_file.exists()  # it exited before binding any port: nothing listened


# -- signed keys --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def signed(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A server that knows no store key, only the operator's public key and a revoked list."""
    from zerohop.gateway.keys.operator_keys import sign

    d = tmp_path_factory.mktemp("signed")
    for pair in ("op", "other"):
        out = cli(
            "keys", "keygen", "--out-private", d / f"{pair}.key", "--out-public", d / f"{pair}.pub"
        )
        assert "--jwt-public-key" in out

    HOUR = ("--expires", "1h")

    def mint(*flags: str, pair: str = "op") -> str:
        token = cli("keys", "sign", "--private-key", d / f"{pair}.key", *flags).strip()
        assert token.count(".") == 2 and "\n" not in token
        return token

    tokens = {
        "good": mint("--key-id", "fleet-1", "--tenant", "fleet", "--expires", "1h"),
        "forever": mint("--key-id", "fleet-2", "--tenant", "fleet", "--no-expiry"),
        "restricted": mint("--key-id", "fleet-3", "--tenant", "fleet", "--models", "x", *HOUR),
        "other_pair": mint("--key-id", "fleet-1", "--tenant", "fleet", *HOUR, pair="other"),
        "revoked_sub": mint("--key-id", "gone-1", "--tenant", "fleet", "--expires", "1h"),
        "revoked_jti": mint("--key-id", "fleet-4", "--tenant", "fleet", "--jti", "jti-gone", *HOUR),
        "later_revoked": mint("--key-id", "fleet-5", "--tenant", "fleet", *HOUR),
        "batcher": mint("--key-id", "fleet-6", "--tenant", "fleet", *HOUR),
        "batch_revoked": mint("--key-id", "fleet-7", "--tenant", "fleet", *HOUR),
    }
    # `keys sign` refuses a past --expires; an expired token needs the library (same signer).
    claims = {"sub": "fleet-old", "tenant": "fleet"}
    tokens["expired"] = sign((d / "op.key").read_bytes(), claims, expires_in=-3600)
    revoked = d / "revoked.txt"
    revoked.write_text("# revoked signed keys\ngone-1\njti-gone  # by token id\n")
    args = ["--jwt-public-key", str(d / "op.pub"), "--revoked", str(revoked)]
    args += ["--allow-nonexpiring-signed-keys"]  # "forever" (tests/test_config_validation)
    args += ["--keys-db", str(d / "store" / "keys.db")]  # an empty store: only signed keys
    srv = LiveServer(llama_dir, args).start(d / "server.log")
    with grpc.insecure_channel(f"127.0.0.1:{srv.grpc_port}") as channel:
        yield {"server": srv, "tokens": tokens, "revoked": revoked, "channel": channel}
    srv.stop()


def test_signed_keys_end_to_end(signed):
    srv, tokens = signed["server"], signed["tokens"]
    stub = pb_grpc.ZerohopStub(signed["channel"])
    assert "no API keys configured" not in srv.log()
    generate = pb.DESCRIPTOR.services_by_name["Zerohop"].methods_by_name["Generate"]
    failures = []
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        for name in ("good", "forever"):
            for route in (("POST", "/v1/messages"), ("POST", "/v1/chat/completions")):
                for style in ("x-api-key", "bearer"):
                    r = http_call(http, route, tokens[name], style)
                    if r.status_code != 200:
                        failures.append(f"{name} {route} {style}: {r.status_code} {r.text}")
            for method in GRPC_METHODS:
                code = grpc_call(stub, method, grpc_metadata(tokens[name], "bearer"))
                if code != grpc.StatusCode.OK:
                    failures.append(f"{name} gRPC {method.name}: {code}")
        refused = {
            "none": None,
            "store-shaped": new_key(),
            **{k: tokens[k] for k in ("expired", "other_pair", "revoked_sub", "revoked_jti")},
        }
        for name, token in refused.items():
            for route in (("POST", "/v1/messages"), ("GET", "/v1/models")):
                r = http_call(http, route, token, "bearer")
                if r.status_code != 401:
                    failures.append(f"{name} {route}: {r.status_code} {r.text[:200]}")
            code = grpc_call(stub, generate, grpc_metadata(token, "bearer"))
            if code != grpc.StatusCode.UNAUTHENTICATED:
                failures.append(f"{name} gRPC Generate: {code}")
        r = http_call(http, ("POST", "/v1/messages"), tokens["restricted"])
        if r.status_code != 403 or r.json()["error"]["type"] != "permission_error":
            failures.append(f"restricted: {r.status_code} {r.text[:200]}")
        code = grpc_call(stub, generate, grpc_metadata(tokens["restricted"]))
        if code != grpc.StatusCode.PERMISSION_DENIED:
            failures.append(f"restricted gRPC: {code}")
        assert not failures, "\n".join(failures)

        # Revoked while the server runs: the file is re-read (about once a second).
        later = tokens["later_revoked"]
        assert http_call(http, ("GET", "/v1/models"), later).status_code == 200
        with signed["revoked"].open("a") as f:
            f.write("fleet-5\n")
        poll(lambda: http_call(http, ("GET", "/v1/models"), later).status_code == 401)


def test_signed_keys_run_batches_until_revoked(signed):
    """A signed key's batch runs its lines as that caller (the batch keeps the token's
    identity: no store holds the key); revoking the key stops the lines not yet run."""
    srv, tokens = signed["server"], signed["tokens"]
    params = {"model": MODEL_NAME, "max_tokens": 24, "temperature": 0}

    def batch(token: str, count: int) -> tuple[anthropic.Anthropic, str]:
        sdk = anthropic.Anthropic(base_url=srv.url, auth_token=token, api_key=None)
        line = {**params, "messages": [{"role": "user", "content": "count"}]}
        lines = [{"custom_id": f"q{i}", "params": line} for i in range(count)]
        return sdk, sdk.messages.batches.create(requests=lines).id

    def results(sdk: anthropic.Anthropic, batch_id: str) -> list:
        poll(lambda: sdk.messages.batches.retrieve(batch_id).processing_status == "ended", 120)
        return list(sdk.messages.batches.results(batch_id))

    sdk, good = batch(tokens["batcher"], 3)
    assert [r.result.type for r in results(sdk, good)] == ["succeeded"] * 3

    sdk, doomed = batch(tokens["batch_revoked"], 40)
    with signed["revoked"].open("a") as f:
        f.write("fleet-7\n")
    refused = [r for r in results(sdk_admin(srv, tokens), doomed) if r.result.type == "errored"]
    assert refused, "lines started after the revocation run no more"
    assert {r.result.error.error.type for r in refused} == {"authentication_error"}


def sdk_admin(srv: LiveServer, tokens: dict) -> anthropic.Anthropic:
    """The revoked key cannot read its batch any more: its tenant's other key can."""
    return anthropic.Anthropic(base_url=srv.url, auth_token=tokens["batcher"], api_key=None)


# -- the CLI ------------------------------------------------------------------------------------


def test_cli_entry_point_subprocess(store):
    """`python -m zerohop keys list --json`, the real console entry point, once."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "zerohop", "keys", "list", "--json", "--keys-db", store["db"]],
        capture_output=True, text=True, env=env, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    listed = json.loads(done.stdout)
    assert {r["key_id"] for r in listed} >= {r["key_id"] for r in store["records"].values()}


def test_cli_list_show_update_tenant_usage(server, http, store):
    db, records = store["db"], store["records"]
    secrets = list(store["keys"].values())

    listed = cli_json("keys", "list", "--keys-db", db)
    by_id = {r["key_id"]: r for r in listed}
    assert set(by_id) >= {r["key_id"] for r in records.values()}
    assert all("key" not in r for r in listed)
    assert by_id[records["revoked"]["key_id"]]["revoked"] is not None
    assert by_id[records["restricted"]["key_id"]]["models"] == ["other-model"]
    table = cli("keys", "list", "--keys-db", db)
    assert records["valid"]["key_id"] in table and "revoked" in table and "expired" in table
    assert [r["tenant"] for r in cli_json("keys", "list", "--tenant", "beta", "--keys-db", db)] == [
        "beta"
    ]

    metered = records["metered"]["key_id"]
    shown = cli_json("keys", "show", metered, "--keys-db", db)
    assert shown == [by_id[metered]]
    updated = cli_json("keys", "update", metered, "--rpm", "7", "--keys-db", db)
    assert updated[0]["limits"]["rpm"] == 7
    again = cli_json("keys", "update", metered, "--otpm", "900", "--keys-db", db)
    assert again[0]["limits"] == {"rpm": 7, "itpm": None, "otpm": 900, "max_concurrency": None}
    assert cli_json("keys", "show", metered, "--keys-db", db)[0]["limits"]["rpm"] == 7

    tenant = cli_json(
        "keys", "tenant", "metered", "--budget", "1000/day", "--weight", "2", "--keys-db", db
    )
    assert tenant["tenant"] == "metered" and tenant["weight"] == 2.0
    assert tenant["budget"] == "1000/day"
    kept = cli_json("keys", "tenant", "metered", "--rpm", "100", "--keys-db", db)
    assert (kept["budget"], kept["weight"], kept["rpm"]) == ("1000/day", 2.0, 100)

    # Spend a few tokens under the tenant's budget (once the server has the budget).
    key = store["keys"]["metered"]
    route = ("POST", "/v1/chat/completions")

    def spent() -> list[dict]:
        r = http_call(http, route, key)
        # The key allows 7 requests a minute (above): polling on a slow machine can use them
        # up before the budget is live; a 429 is that limit, so poll on.
        if r.status_code == 429 and "7 requests per minute" in r.text:
            return []
        assert r.status_code == 200, r.text
        return [u for u in cli_json("keys", "usage", "--keys-db", db) if u["tokens"] > 0]

    poll(lambda: any(u["subject"] == "tenant:metered" for u in spent()))
    usage = cli_json("keys", "usage", "--keys-db", db)
    row = next(u for u in usage if u["subject"] == "tenant:metered")
    assert row["period"].startswith("day:") and row["budget"] == 1000
    assert 0 < row["tokens"] < 1000 and row["remaining"] == 1000 - row["tokens"]

    # The secrets are nowhere: not in list/show output, the store, the audit log or the log.
    outputs = [
        cli("keys", "list", "--keys-db", db),
        cli("keys", "list", "--json", "--keys-db", db),
        *(cli("keys", "show", r["key_id"], "--keys-db", db) for r in records.values()),
        *(cli("keys", "show", r["key_id"], "--json", "--keys-db", db) for r in records.values()),
    ]
    for out in outputs:
        assert not secret_free(out, secrets), out
    data = db_bytes(db)
    assert not secret_free(data, secrets)
    assert all(hash_secret(s).encode() in data for s in secrets)  # the right file: hashes
    audit = b"".join(p.read_bytes() for p in (db.parent / "audit").rglob("*") if p.is_file())
    assert audit, "no audit log beside the store"
    assert not secret_free(audit, secrets)
    assert not secret_free(server.log(), secrets)
