"""The gRPC surface on a live `zerohop serve`, driven by the real grpcio client."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import time
from pathlib import Path

import grpc
import httpx
import pytest
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from tests.live_server import MODEL_NAME, LiveServer
from zerohop import LLM, SamplingParams
from zerohop.api.grpc.service import start_grpc_server
from zerohop.api.serving.service import ServingContext
from zerohop.engine.process.async_engine import AsyncEngine
from zerohop.engine.text.tokenizer import Tokenizer
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2 as pb
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is a cache?"},
]
LONG = {"max_tokens": 1500, "ignore_eos": True}
STEP_DELAY = 0.05  # on the slow server, LONG runs 75 s: far past any wait below


@pytest.fixture(scope="module")
def channel(live_server):
    with grpc.insecure_channel(f"127.0.0.1:{live_server.grpc_port}") as channel:
        yield channel


@pytest.fixture(scope="module")
def stub(channel) -> pb_grpc.ZerohopStub:
    return pb_grpc.ZerohopStub(channel)


def _slow_server(llama_dir, folder: Path) -> LiveServer:
    """A server whose engine sleeps after each step, so a request outlives its client."""
    return LiveServer(llama_dir, ["--debug-step-delay", str(STEP_DELAY)]).start(
        folder / "server.log"
    )


@pytest.fixture(scope="module")
def slow_server(llama_dir, tmp_path_factory):
    server = _slow_server(llama_dir, tmp_path_factory.mktemp("slow_server"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def slow_stub(slow_server):
    with grpc.insecure_channel(f"127.0.0.1:{slow_server.grpc_port}") as channel:
        yield pb_grpc.ZerohopStub(channel)


@pytest.fixture(scope="module")
def offline(llama_dir) -> LLM:
    return LLM(llama_dir, num_kv_blocks=256)


def _request(**fields) -> pb.GenerateRequest:
    fields.setdefault("model", MODEL_NAME)
    fields.setdefault("temperature", 0.0)
    if isinstance(fields.get("prompt_token_ids"), list):
        fields["prompt_token_ids"] = pb.TokenIds(ids=fields["prompt_token_ids"])
    if isinstance(fields.get("messages"), list):
        fields["messages"] = pb.ChatMessages(
            messages=[pb.ChatMessage(**m) for m in fields["messages"]]
        )
    return pb.GenerateRequest(**fields)


def _collect(stub, request: pb.GenerateRequest) -> tuple[list[int], str, list]:
    messages = list(stub.Generate(request, timeout=60))
    token_ids = [t for m in messages for t in m.token_ids]
    return token_ids, "".join(m.text for m in messages), messages


def _check_like_offline(stub, offline: LLM, request, prompt, params: SamplingParams) -> list:
    token_ids, text, messages = _collect(stub, request)
    expected = offline.generate(prompt, params)[0]
    assert token_ids == expected.token_ids
    assert text == expected.text
    # One message per engine step: a lone request gets one token per step, sent at once.
    assert all(len(m.token_ids) <= 1 for m in messages)
    final = messages[-1]
    assert all(not m.HasField("usage") for m in messages[:-1])
    reason = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}
    assert final.finish_reason == reason[expected.finish_reason]
    assert final.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert final.usage.completion_tokens == len(expected.token_ids)
    return messages


def test_generate_text_prompt_matches_offline(stub, offline) -> None:
    prompt = "The quick brown fox"
    request = _request(prompt=prompt, max_tokens=12)
    params = SamplingParams(temperature=0, max_tokens=12)
    _check_like_offline(stub, offline, request, prompt, params)
    call = stub.Generate(request)
    assert list(call)
    assert dict(call.initial_metadata())["request-id"].startswith("req_")


def test_generate_token_ids_matches_offline(stub, offline) -> None:
    ids = offline.tokenizer.encode("Once upon a time")
    request = _request(prompt_token_ids=ids, max_tokens=10, ignore_eos=True)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    messages = _check_like_offline(stub, offline, request, ids, params)
    assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert messages[-1].usage.completion_tokens == 10


def test_generate_chat_messages_matches_offline(stub, offline) -> None:
    ids = offline.tokenizer.encode_chat(CHAT)
    request = _request(messages=CHAT, max_tokens=8)
    _check_like_offline(stub, offline, request, ids, SamplingParams(temperature=0, max_tokens=8))


def test_stop_token_and_logprobs(stub, offline) -> None:
    ids = offline.tokenizer.encode("Stop here")
    greedy = offline.generate(ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    stop_id = greedy[0].token_ids[2]
    request = _request(prompt_token_ids=ids, max_tokens=6, stop_token_ids=[stop_id], logprobs=2)
    token_ids, _, messages = _collect(stub, request)
    assert token_ids == greedy[0].token_ids[: greedy[0].token_ids.index(stop_id) + 1]
    assert messages[-1].finish_reason == pb.FINISH_REASON_STOP
    assert messages[-1].WhichOneof("stop_reason") == "stop_token_id"
    assert messages[-1].stop_token_id == stop_id
    logprobs = [lp for m in messages for lp in m.logprobs]
    assert len(logprobs) == len(token_ids)
    for token, lp in zip(token_ids, logprobs, strict=True):
        assert lp.top[0].token_id == token  # greedy: the chosen token is the most likely
        assert lp.logprob == lp.top[0].logprob <= 0
        assert len(lp.top) == 2


def test_null_fields_are_unset(stub, offline) -> None:
    # gRPC has no null on the wire; in its JSON form a null field is unset, and unset is the
    # default here (temperature 1, no logprobs, ...), as on the HTTP surfaces.
    nulls = dict.fromkeys(["temperature", "topP", "topK", "seed", "stop", "logprobs"])
    body = {"model": MODEL_NAME, "prompt": "Hello", "maxTokens": 4, "ignoreEos": True, **nulls}
    request = json_format.Parse(json.dumps(body), pb.GenerateRequest())
    assert not any(request.HasField(name) for name in ("temperature", "top_p", "logprobs"))
    token_ids, _, messages = _collect(stub, request)
    assert len(token_ids) == 4 and not any(m.logprobs for m in messages)


def test_count_tokens(stub, offline) -> None:
    count = stub.CountTokens
    text = "Count these tokens please"
    assert count(pb.CountTokensRequest(model=MODEL_NAME, prompt=text)).input_tokens == len(
        offline.tokenizer.encode(text)
    )
    ids = pb.TokenIds(ids=[5, 6, 7])
    assert count(pb.CountTokensRequest(model=MODEL_NAME, prompt_token_ids=ids)).input_tokens == 3
    chat = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in CHAT])
    assert count(pb.CountTokensRequest(model=MODEL_NAME, messages=chat)).input_tokens == len(
        offline.tokenizer.encode_chat(CHAT)
    )


BAD_REQUESTS = {
    "no input": ({}, grpc.StatusCode.INVALID_ARGUMENT, "required"),
    "empty messages": ({"messages": []}, grpc.StatusCode.INVALID_ARGUMENT, "messages"),
    "max_tokens 0": ({"prompt": "hi", "max_tokens": 0}, grpc.StatusCode.INVALID_ARGUMENT, "max_"),
    "negative temperature": (
        {"prompt": "hi", "temperature": -0.5},
        grpc.StatusCode.INVALID_ARGUMENT,
        "temperature",
    ),
    "nan temperature": (
        {"prompt": "hi", "temperature": float("nan")},
        grpc.StatusCode.INVALID_ARGUMENT,
        "temperature",
    ),
    "top_p 0": ({"prompt": "hi", "top_p": 0.0}, grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    "logprobs 21": ({"prompt": "hi", "logprobs": 21}, grpc.StatusCode.INVALID_ARGUMENT, "logprob"),
    "unknown model": ({"prompt": "hi", "model": "gpt-9"}, grpc.StatusCode.NOT_FOUND, "gpt-9"),
    "prompt too long": (
        {"prompt_token_ids": [7] * 2048},
        grpc.StatusCode.INVALID_ARGUMENT,
        "2048 tokens",
    ),
    "max_tokens past the context": (
        {"prompt_token_ids": [7] * 100, "max_tokens": 2000},
        grpc.StatusCode.INVALID_ARGUMENT,
        "2100",
    ),
    "token id outside the vocabulary": (
        {"prompt_token_ids": [7, 10**6]},
        grpc.StatusCode.INVALID_ARGUMENT,
        "token ids",
    ),
}


@pytest.mark.parametrize("fields", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_generate_requests(stub, fields) -> None:
    fields, code, words = fields
    with pytest.raises(grpc.RpcError) as info:
        _collect(stub, _request(**fields))
    assert info.value.code() == code
    assert words in info.value.details()
    assert _collect(stub, _request(prompt="still serving", max_tokens=2))[0]


def test_bad_count_tokens_requests(stub) -> None:
    cases = [
        (pb.CountTokensRequest(model=MODEL_NAME), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.CountTokensRequest(model="nope", prompt="x"), grpc.StatusCode.NOT_FOUND),
    ]
    for request, code in cases:
        with pytest.raises(grpc.RpcError) as info:
            stub.CountTokens(request)
        assert info.value.code() == code


def test_health_and_reflection(channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "zerohop.v1.Zerohop"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as info:
        health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()

    database = ProtoReflectionDescriptorDatabase(channel)
    services = database.get_services()
    assert "zerohop.v1.Zerohop" in services
    assert "grpc.health.v1.Health" in services
    found = database.FindFileContainingSymbol("zerohop.v1.Zerohop")
    assert found.name == "zerohop/v1/zerohop.proto"


def _engine_stats(server) -> dict:
    return httpx.get(server.url + "/engine/stats", timeout=5).json()


def _wait_engine_idle(server, timeout: float = 30.0) -> dict:
    """The engine's counters once no request runs, or after `timeout` if one still does."""
    deadline = time.monotonic() + timeout
    while True:
        stats = _engine_stats(server)
        idle = stats["num_running"] == 0 and stats["num_waiting"] == 0
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def _assert_freed_and_serving(server, stub) -> None:
    stats = _wait_engine_idle(server)
    assert stats["num_running"] == 0  # aborted: LONG would still be running
    assert stats["blocks_in_use"] == 0
    assert _collect(stub, _request(prompt="still serving", max_tokens=3))[0]


def test_cancel_aborts_the_engine_request(slow_stub, slow_server) -> None:
    call = slow_stub.Generate(_request(prompt="cancel me", **LONG))
    first = next(call)
    assert len(first.token_ids) == 1
    # The token arrived while its request still runs: streamed, not buffered.
    assert _engine_stats(slow_server)["num_running"] == 1
    call.cancel()
    assert call.code() == grpc.StatusCode.CANCELLED
    _assert_freed_and_serving(slow_server, slow_stub)


def test_deadline_aborts_the_engine_request(slow_stub, slow_server) -> None:
    received = []
    with pytest.raises(grpc.RpcError) as info:
        for message in slow_stub.Generate(_request(prompt="too slow", **LONG), timeout=0.5):
            received.extend(message.token_ids)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert len(received) < LONG["max_tokens"]
    _assert_freed_and_serving(slow_server, slow_stub)


@pytest.fixture
def doomed_server(llama_dir, tmp_path):
    """A slow server of its own, for the test that kills its engine process."""
    server = _slow_server(llama_dir, tmp_path)
    yield server
    server.stop()


@pytest.fixture
def doomed_stub(doomed_server):
    with grpc.insecure_channel(f"127.0.0.1:{doomed_server.grpc_port}") as channel:
        yield pb_grpc.ZerohopStub(channel)


def test_engine_death_is_unavailable_until_it_restarts(doomed_stub, doomed_server) -> None:
    """Kills the engine process, of a server of its own: the call in flight and the calls
    while it restarts are UNAVAILABLE with a retry-after, health NOT_SERVING; then the
    restarted engine serves them again."""
    pid = doomed_server.process.pid
    tasks = Path(f"/proc/{pid}/task").glob("*/children")
    (engine_pid,) = [int(child) for task in tasks for child in task.read_text().split()]
    call = doomed_stub.Generate(_request(prompt="doomed", **LONG), timeout=60)
    next(call)
    os.kill(engine_pid, signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "restarting" in info.value.details()
    assert int(dict(info.value.trailing_metadata())["retry-after"]) >= 1
    deadline = time.monotonic() + 120  # a safety net only
    while True:
        try:
            token_ids, _, _ = _collect(doomed_stub, _request(prompt="again", max_tokens=2))
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            assert time.monotonic() < deadline, "the engine was not restarted"
            time.sleep(0.1)
    assert len(token_ids) == 2
    with grpc.insecure_channel(f"127.0.0.1:{doomed_server.grpc_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service=""))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_second_server_cannot_take_the_port(live_server, llama_dir) -> None:
    """Without ("grpc.so_reuseport", 0) this bind succeeds and the two servers share the port."""
    ctx = ServingContext(AsyncEngine(), Tokenizer.from_dir(llama_dir), MODEL_NAME, 2048)

    async def start() -> None:
        server, _ = await start_grpc_server(ctx, "127.0.0.1", live_server.grpc_port)
        await server.stop(None)

    with pytest.raises(RuntimeError):
        asyncio.run(start())


def test_the_grpc_port_bound_is_reported(live_server) -> None:
    # --grpc-port auto (LiveServer's): the port gRPC bound, in --port-file and on stdout.
    ports = json.loads(live_server.port_file.read_text())
    assert ports == {"http": live_server.port, "grpc": live_server.grpc_port}
    assert live_server.grpc_port not in (None, 0, live_server.port)
    assert f", gRPC on 127.0.0.1:{live_server.grpc_port}\n" in live_server.log()


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gen_grpc", ROOT / "scripts" / "gen_grpc.py")
    gen_grpc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_grpc)
    gen_grpc.generate(tmp_path)
    committed = ROOT / "zerohop" / "grpc_gen"
    for name in gen_grpc.GENERATED:
        assert (tmp_path / name).read_bytes() == (committed / name).read_bytes(), (
            f"{name} is stale: run `python scripts/gen_grpc.py`"
        )
