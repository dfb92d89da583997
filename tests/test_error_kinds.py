"""Each kind of refusal on each surface (Messages, Chat, Completions, Responses, gRPC): an
invalid request, a per-key rate limit, a token budget the request does not fit in. The status
is the API's own, and the audit record (`status`, `error_type`) and the `zerohop_requests`
metric say the same on every surface. (A client that hangs up: tests/test_client_gone.py.)"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from tests.live_server import MODEL_NAME, LiveServer
from tests.test_gateway_limits import create_keys, records_of, requests_counted, wait_until
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2 as pb
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2_grpc as pb_grpc

CHAT = [{"role": "user", "content": "Tell me about the quick brown fox."}]
SURFACES = ["messages", "chat", "completions", "responses", "grpc"]
METRIC_SURFACE = {"messages": "anthropic", "grpc": "grpc"}  # the rest: "openai"
OK, INVALID, LIMITED = (200, None), (400, "invalid_request"), (429, "rate_limit_requests")
BUDGET = (429, "budget")
# kind: (the key's flags, the request's fields, each request's (status, error_type))
KINDS: dict[str, tuple[list[str], dict[str, Any], list[tuple[int, str | None]]]] = {
    "invalid": ([], {"temperature": -1.0}, [INVALID]),
    "limit": (["--rpm", "1"], {}, [OK, LIMITED]),
    "budget": (["--budget", "8"], {}, [BUDGET, BUDGET]),
}
GRPC_CODES = {
    200: grpc.StatusCode.OK,
    400: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
KEYS = {f"{s}-{k}": (f"{s}-{k}", flags) for s in SURFACES for k, (flags, _, _) in KINDS.items()}


def http_request(server: LiveServer, surface: str, key: str, fields: dict[str, Any]) -> int:
    path, body = {
        "messages": ("/v1/messages", {"max_tokens": 8, "messages": CHAT}),
        "chat": ("/v1/chat/completions", {"max_tokens": 8, "messages": CHAT}),
        "completions": ("/v1/completions", {"max_tokens": 8, "prompt": "The quick brown fox"}),
        "responses": ("/v1/responses", {"max_output_tokens": 8, "input": CHAT}),
    }[surface]
    headers = {"x-api-key": key, "authorization": f"Bearer {key}"}
    request = {"model": MODEL_NAME, **body, **fields}
    return httpx.post(server.url + path, json=request, headers=headers, timeout=60).status_code


def grpc_request(server: LiveServer, key: str, fields: dict[str, Any]) -> grpc.StatusCode:
    request = pb.GenerateRequest(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=8)
    if "temperature" in fields:
        request.temperature = fields["temperature"]
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        call = pb_grpc.ZerohopStub(channel).Generate(request, metadata=(("x-api-key", key),))
        with contextlib.suppress(grpc.RpcError):  # its code tells
            list(call)
        return call.code()


@pytest.fixture(scope="module")
def served(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    root = tmp_path_factory.mktemp("error_kinds")
    db, audit = root / "keys.db", root / "audit"
    keys = create_keys(db, KEYS)
    server = LiveServer(llama_dir, ["--keys-db", str(db), "--audit-dir", str(audit)])
    server.start(root / "server.log")
    yield server, audit, keys
    server.stop()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("surface", SURFACES)
def test_each_kind_of_refusal_on_each_surface(served: Any, surface: str, kind: str) -> None:
    server, audit, keys = served
    name = f"{surface}-{kind}"
    _, fields, expected = KINDS[kind]
    key = keys[name]["key"]
    for status, _ in expected:
        if surface == "grpc":
            assert grpc_request(server, key, fields) == GRPC_CODES[status]
        else:
            assert http_request(server, surface, key, fields) == status
    records = records_of(audit, keys[name], len(expected))
    assert [(r["status"], r["error_type"]) for r in records] == expected
    label = METRIC_SURFACE.get(surface, "openai")
    by_status: dict[str, float] = {}
    for status, _ in expected:
        by_status[f"{label}:{status}"] = by_status.get(f"{label}:{status}", 0.0) + 1
    tenant = keys[name]["tenant"]
    assert wait_until(lambda: requests_counted(server, tenant) == by_status, 3)
