"""No error body carries a traceback, a file path or an internal exception's text.

conftest checks every error the suite's servers record (zerohop.api.http.error_record) after each
test; these tests show the record is written for each surface, so that check cannot pass by
seeing nothing, and that the patterns tell a leak from an API message."""

from __future__ import annotations

import asyncio
import json
import traceback

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from tests.error_bodies import ErrorRecord, leaks, offenders, read_records
from tests.live_server import MODEL_NAME, LiveServer
from zerohop.api.grpc import error_record as grpc_error_record
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2 as pb
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2_grpc as pb_grpc

# Messages the API sends: none is a leak.
API_MESSAGES = [
    "max_tokens: Field required",
    "Invalid value for 'temperature': Expected `float`, got `str`",
    "Unrecognized request argument supplied: max_token",
    "Missing required parameter: 'model'.",
    "the request body is not valid JSON: JSON is malformed: invalid character (byte 24)",
    "model: claude-opus-9 is not served here (this server serves tiny-llama)",
    "prompt is too long: 2500 tokens > 2048 maximum",
    "messages.0.content.0.type: 'image' content blocks are not supported by this server",
    "internal error (request req_0123456789abcdef)",
    "POST /v1/nothing: not found",
    "rate limit exceeded for key zh_test: 0 requests per minute allowed",
    "the server is shutting down or its engine is unavailable",
]


def _traceback() -> str:
    try:
        {}["missing"]
    except KeyError:
        return traceback.format_exc()
    raise AssertionError("unreachable")


LEAKS = {
    "traceback": _traceback(),
    "json-escaped traceback": json.dumps({"error": {"message": _traceback()}}),
    "sse error event": "event: error\ndata: "
    + json.dumps({"type": "error", "error": {"message": _traceback()}}),
    "grpc unexpected": "Unexpected <class 'ZeroDivisionError'>: division by zero",
    "exception text": "generation failed: EngineBrokenError: assert seq.weight > 0",
    "os error": "[Errno 9] Bad file descriptor",
    "host path": "cannot open /tmp/zerohop/keys.db",
    "module": "in fair_share.py at admit",
    "package path": "in /opt/venv/lib/python3.11/site-packages/torch",
}


@pytest.mark.parametrize("message", API_MESSAGES)
def test_api_messages_are_not_leaks(message: str) -> None:
    assert leaks(message) == []
    assert leaks(json.dumps({"error": {"message": message, "param": None}})) == []


@pytest.mark.parametrize("name", list(LEAKS))
def test_leaks_are_found(name: str) -> None:
    assert leaks(LEAKS[name]), LEAKS[name]


def test_offenders_name_where_and_what() -> None:
    records = [
        {
            "surface": "http",
            "where": "POST /v1/messages",
            "status": 500,
            "body": LEAKS["traceback"],
        },
        {"surface": "http", "where": "GET /nope", "status": 404, "body": API_MESSAGES[-3]},
    ]
    (found,) = offenders(records)
    assert found.startswith("http POST /v1/messages -> 500: ") and "a traceback," in found


def _recorded_since(error_record: ErrorRecord, offset: int) -> list[dict]:
    return read_records(error_record.path, offset)[0]


def _size(error_record: ErrorRecord) -> int:
    return error_record.path.stat().st_size if error_record.path.exists() else 0


def test_http_error_responses_are_recorded(live_server: LiveServer, error_record) -> None:
    start = _size(error_record)
    missing = httpx.post(live_server.url + "/v1/nothing", json={})
    bad = httpx.post(live_server.url + "/v1/messages", json={"model": MODEL_NAME})
    ok = httpx.get(live_server.url + "/health")
    assert (missing.status_code, bad.status_code, ok.status_code) == (404, 400, 200)
    recorded = {r["where"]: r for r in _recorded_since(error_record, start)}
    assert set(recorded) == {"POST /v1/nothing", "POST /v1/messages"}, recorded
    assert recorded["POST /v1/messages"]["body"] == bad.text
    assert recorded["POST /v1/messages"]["status"] == 400


def test_grpc_error_statuses_are_recorded(live_server: LiveServer, error_record) -> None:
    start = _size(error_record)
    with grpc.insecure_channel(f"127.0.0.1:{live_server.grpc_port}") as channel:
        stub = pb_grpc.ZerohopStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(pb.GenerateRequest(model=MODEL_NAME), timeout=30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    (record,) = _recorded_since(error_record, start)
    assert record["surface"] == "grpc" and record["where"] == "/zerohop.v1.Zerohop/Generate"
    assert record["status"] == "INVALID_ARGUMENT"
    assert record["body"] == refused.value.details()


class _FailingHealth(health_aio.HealthServicer):
    """Check: aborts for "abort", raises what no handler catches for "raise"."""

    async def Check(self, request, context):
        if request.service == "abort":
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such service")
        raise ValueError("internal detail")


def test_grpc_records_what_the_client_gets(tmp_path) -> None:
    # An uncaught exception is recorded in grpc.aio's own words, as the client receives them.
    path = tmp_path / "errors.jsonl"

    async def run() -> list[str]:
        server = grpc.aio.server(interceptors=[grpc_error_record._GrpcErrors(path)])
        health_pb2_grpc.add_HealthServicer_to_server(_FailingHealth(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        details = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("abort", "raise"):
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await stub.Check(health_pb2.HealthCheckRequest(service=service))
                details.append(failed.value.details())
        await server.stop(None)
        return details

    details = asyncio.run(run())
    records, _ = read_records(path)
    assert [r["body"] for r in records] == details
    assert [r["status"] for r in records] == ["NOT_FOUND", "UNKNOWN"]
    assert leaks(details[1]) == ["a Python class", "an exception class name"]
