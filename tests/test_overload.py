"""Overload: with a small queue, a flood of 200 concurrent requests each either completes or
is refused at once with the protocol's overload error and a retry-after; none hangs, none
is lost, and /health answers throughout. Every response carries the replica's load."""

from __future__ import annotations

import asyncio
from pathlib import Path

import anthropic
import grpc
import httpx
import pytest

from tests.live_server import MODEL_NAME, LiveServer, engine_has
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2 as pb
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2_grpc as pb_grpc

MAX_WAITING = 4
FLOOD = 200
LOAD_HEADERS = ("zerohop-running", "zerohop-waiting", "zerohop-kv-usage")


@pytest.fixture(scope="module")
def small_queue(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("small_queue") / "server.log"
    args = ["--max-waiting", str(MAX_WAITING), "--max-num-seqs", "2", "--debug-step-delay", "0.01"]
    server = LiveServer(llama_dir, args).start(log)
    yield server
    server.stop()


def _body(surface: str, i: int) -> tuple[str, dict]:
    content = f"Request number {i}: say something."
    if surface == "anthropic":
        messages = [{"role": "user", "content": content}]
        body = {"model": MODEL_NAME, "max_tokens": 4, "messages": messages}
        return "/v1/messages", body
    messages = [{"role": "user", "content": content}]
    return "/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 4, "messages": messages}


async def _one(client: httpx.AsyncClient, i: int) -> tuple[str, httpx.Response]:
    surface = "anthropic" if i % 2 else "openai"
    path, body = _body(surface, i)
    if i % 4 in (2, 3):
        body["stream"] = True
    response = await client.post(path, json=body)
    return surface, response


async def _flood(server: LiveServer) -> tuple[list[tuple[str, httpx.Response]], list[int]]:
    limits = httpx.Limits(max_connections=FLOOD + 10, max_keepalive_connections=FLOOD + 10)
    health: list[int] = []
    async with httpx.AsyncClient(base_url=server.url, timeout=60.0, limits=limits) as client:
        done = asyncio.Event()

        async def watch_health() -> None:
            while not done.is_set():
                # /health stalled: a timeout raised here (30 s: a safety net, not a latency
                # figure; test_server_lifecycle answers it with the engine frozen).
                response = await client.get("/health", timeout=30.0)
                health.append(response.status_code)
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch_health())
        results = await asyncio.wait_for(
            asyncio.gather(*(_one(client, i) for i in range(FLOOD))), timeout=180
        )
        done.set()
        await watcher
    return results, health


def test_a_flood_is_served_or_refused_with_retry_after(small_queue: LiveServer) -> None:
    results, health = asyncio.run(_flood(small_queue))
    assert len(results) == FLOOD
    served = refused = 0
    for surface, response in results:
        for name in LOAD_HEADERS:
            assert name in response.headers, (name, response.status_code)
        if response.status_code == 200:
            served += 1
            assert response.text, "an answer"
            continue
        refused += 1
        expected = 529 if surface == "anthropic" else 503
        assert response.status_code == expected, response.text
        assert int(response.headers["retry-after"]) >= 1
        error = response.json()
        if surface == "anthropic":
            assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"
        else:
            assert error["error"]["code"] == "overloaded"
    assert served >= 2 and refused >= 1, (served, refused)
    assert served + refused == FLOOD
    assert health and set(health) == {200}
    ready = httpx.get(small_queue.url + "/ready")
    assert ready.status_code == 200, "overload is not ill health"
    metrics = httpx.get(small_queue.url + "/metrics").text
    assert 'zerohop_refusals_total{reason="overloaded"' in metrics, metrics[-2000:]


async def _fill_the_queue(client: httpx.AsyncClient, tag: str) -> list[asyncio.Task]:
    """Two long requests running (max-num-seqs 2), then MAX_WAITING more queued behind."""
    long = {"model": MODEL_NAME, "max_tokens": 300, "ignore_eos": True}

    def send(i: int) -> asyncio.Task:
        return asyncio.create_task(
            client.post("/v1/completions", json={**long, "prompt": f"{tag}{i}"})
        )

    hogs = [send(0), send(1)]
    await engine_has(client, running=2, waiting=0)
    hogs += [send(i) for i in range(2, 2 + MAX_WAITING)]
    await engine_has(client, running=2, waiting=MAX_WAITING)
    return hogs


async def _release(client: httpx.AsyncClient, hogs: list[asyncio.Task]) -> None:
    """The hogs' callers hang up (~9 s sooner than their 300 tokens would end): the server
    aborts them all, and the engine is idle again for the next test."""
    for hog in hogs:
        hog.cancel()
    await asyncio.gather(*hogs, return_exceptions=True)
    await engine_has(client, running=0, waiting=0)


def test_the_sdk_gets_529_with_retry_after(small_queue: LiveServer) -> None:
    """With the queue held full, the anthropic SDK gets 529 with retry-after (which its
    default max_retries would honour)."""

    async def hold_queue_and_ask() -> tuple[int, str]:
        limits = httpx.Limits(max_connections=50)
        async with httpx.AsyncClient(base_url=small_queue.url, timeout=120, limits=limits) as c:
            hogs = await _fill_the_queue(c, "x")
            sdk = anthropic.AsyncAnthropic(base_url=small_queue.url, api_key="k", max_retries=0)
            with pytest.raises(anthropic.APIStatusError) as refused:
                await sdk.messages.create(
                    model=MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
                )
            await _release(c, hogs)
            return refused.value.status_code, refused.value.response.headers["retry-after"]

    status, retry_after = asyncio.run(hold_queue_and_ask())
    assert status == 529 and int(retry_after) >= 1


def test_grpc_reports_load_and_refuses_with_unavailable(small_queue: LiveServer) -> None:
    async def run() -> tuple[grpc.StatusCode, dict, dict]:
        limits = httpx.Limits(max_connections=50)
        async with httpx.AsyncClient(base_url=small_queue.url, timeout=120, limits=limits) as c:
            hogs = await _fill_the_queue(c, "y")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{small_queue.grpc_port}") as ch:
                # Connected first: UNAVAILABLE must be the server's refusal, not a slow connect.
                await asyncio.wait_for(ch.channel_ready(), 30)
                stub = pb_grpc.ZerohopStub(ch)
                request = pb.GenerateRequest(model=MODEL_NAME, prompt="hi", max_tokens=2)
                call = stub.Generate(request)
                try:
                    async for _ in call:
                        pass
                    code = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as exc:
                    code = exc.code()
                initial = dict(await call.initial_metadata())
                trailing = dict(await call.trailing_metadata())
            await _release(c, hogs)
            return code, initial, trailing

    code, initial, trailing = asyncio.run(run())
    assert code == grpc.StatusCode.UNAVAILABLE, (initial, trailing)
    # The refusal's trailers carry the load; the initial metadata may not reach the client
    # (gRPC may deliver a call that ends in an error alone as Trailers-Only).
    assert int(trailing["zerohop-waiting"]) >= MAX_WAITING, (initial, trailing)
    assert int(trailing["retry-after"]) >= 1


def _engine_with_queue(queued: list[tuple[str, int, int]]):
    """A (never started) AsyncEngine holding this queue, idle, whose steps take 10 ms a token
    (100 tokens/s at any size) with 256 tokens a step."""
    from zerohop.engine.process.async_engine import AsyncEngine, Queued

    engine = AsyncEngine()
    engine.queued = {
        f"r{i}": Queued(tokens, tenant, 1.0, priority)
        for i, (tenant, tokens, priority) in enumerate(queued)
    }
    engine.latest_stats = {
        "num_running": 0, "num_blocks": 10000, "blocks_in_use": 5000, "blocks_free": 5000,
        "block_size": 16, "max_num_seqs": 256, "max_num_batched_tokens": 256,
        "step_times": {"decode": [[1.0, 0.01]], "prefill": [[1.0, 0.01], [256.0, 2.56]]},
        "remaining_tokens": [],
    }  # fmt: skip
    return engine


def test_a_flooding_tenant_is_refused_and_the_others_are_not() -> None:
    from zerohop.api.errors import ApiError
    from zerohop.api.load.overload import AdmissionControl
    from zerohop.engine.process.async_engine import Queued

    engine = _engine_with_queue([("flood", 100, 0)] * 10)
    control = AdmissionControl(engine, max_queue_wait=5.0, max_waiting=100)
    with pytest.raises(ApiError) as refused:
        control.check("anthropic", Queued(100, "flood", 1.0, 0))
    assert refused.value.status == 529 and refused.value.code == "overloaded"
    # 1,000 tokens ahead: three whole steps of 256 (2.56 s each) before its own starts.
    assert dict(refused.value.headers)[b"retry-after"] == b"3"  # 7.68 s of wait, 5 allowed
    admitted = control.check("openai", Queued(100, "light", 1.0, 0))  # its turn comes next
    assert admitted.queue_wait == 0.0
    assert control.load().queue_wait == pytest.approx(7.68)
    assert control.load().kv_usage == 0.5

    fcfs = AdmissionControl(engine, max_queue_wait=5.0, max_waiting=100, fair_share=False)
    with pytest.raises(ApiError) as refused:
        fcfs.check("openai", Queued(100, "light", 1.0, 0))
    assert refused.value.status == 503, "in arrival order the light tenant waits too"


def test_batch_work_queued_does_not_refuse_interactive_work() -> None:
    from zerohop.api.errors import ApiError
    from zerohop.api.load.overload import AdmissionControl
    from zerohop.engine.process.async_engine import Queued

    engine = _engine_with_queue([("bulk", 500, 1)] * 4 + [("chat", 100, 0)])
    control = AdmissionControl(engine, max_queue_wait=5.0, max_waiting=100)
    control.check("openai", Queued(100, "chat2", 1.0, 0))  # behind 100 interactive tokens
    with pytest.raises(ApiError):
        control.check("openai", Queued(100, "bulk", 1.0, 1))  # behind all of it
    with pytest.raises(ApiError, match="already waiting"):
        AdmissionControl(engine, max_waiting=5).check("openai", Queued(1, "x", 1.0, 0))
