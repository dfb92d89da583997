"""Streams that survive a slow prefill (issue 38), over real sockets on one live server.

The server prefills in chunks of 32 tokens and sleeps 0.05 s after each engine step, so a
prompt of several hundred tokens spans many steps: the stream starts at admission and pings
while it is prefilled. Nothing asserts a duration: only the order of what arrives, and the
engine's counters (GET /engine/stats, /metrics).
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from tests.live_server import MODEL_NAME, LiveServer, engine_has
from zerohop import sse

CHUNK = 32  # --max-num-batched-tokens: a prompt's prefill takes one step per CHUNK tokens


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("slow_prefill") / "server.log"
    args = ["--debug-step-delay", "0.05", "--max-num-batched-tokens", str(CHUNK)]
    args += ["--stream-ping-interval", "0.05", "--openai-ping-interval", "0.05"]
    srv = LiveServer(llama_dir, extra_args=args).start(log)
    yield srv
    srv.stop()


def long_prompt(salt: str) -> str:
    """A prompt of several hundred tokens; its start differs by `salt`, so no test reads
    another's prefill from the prefix cache."""
    return salt + " " + " ".join(f"w{i}" for i in range(300))


def message_body(salt: str, **extra: object) -> dict:
    body = {"model": MODEL_NAME, "max_tokens": 6, "stream": True, "temperature": 0}
    return {**body, "messages": [{"role": "user", "content": long_prompt(salt)}], **extra}


def names(chunks: Iterator[bytes]) -> list[tuple[str, dict]]:
    return [
        (e.name.decode() if e.name else "", json.loads(e.data))
        for e in sse.events(chunks)
        if e.data is not None
    ]


def stats(server: LiveServer) -> dict:
    return httpx.get(server.url + "/engine/stats").json()


def engine_requests(server: LiveServer) -> int:
    """The engine's request counter, as /metrics shows it."""
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("zerohop_engine_requests_total "):
            return int(float(line.split()[1]))
    raise AssertionError("no zerohop_engine_requests_total in /metrics")


def settle(server: LiveServer) -> None:
    async def wait() -> None:
        async with httpx.AsyncClient(base_url=server.url) as client:
            await engine_has(client, 0, 0)

    asyncio.run(wait())


# -- the stream starts at admission and pings ------------------------------------------------


def test_anthropic_stream_starts_at_admission_and_pings_while_prefilling(server) -> None:
    body = message_body("anthropic-pings")
    only = {"model": MODEL_NAME, "messages": body["messages"]}
    counted = httpx.post(server.url + "/v1/messages/count_tokens", json=only).json()
    assert counted["input_tokens"] > 5 * CHUNK  # the prefill spans several steps
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=60) as response:
        assert response.status_code == 200
        events = names(response.iter_bytes())
    kinds = [name for name, _ in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    first_delta = kinds.index("content_block_delta")
    # The ping after content_block_start is the API's; the others came while prefilling.
    assert kinds[:first_delta].count("ping") >= 2, kinds
    assert kinds[-1] == "message_stop"
    start_usage = events[0][1]["message"]["usage"]
    total = start_usage["input_tokens"] + start_usage["cache_read_input_tokens"]
    assert total == counted["input_tokens"]
    end_usage = next(data for name, data in events if name == "message_delta")["usage"]
    assert end_usage["input_tokens"] + end_usage["cache_read_input_tokens"] == total
    assert end_usage["output_tokens"] == 6


def test_anthropic_message_start_reports_the_expected_cache_read(server) -> None:
    body = message_body("anthropic-cache")
    httpx.post(server.url + "/v1/messages", json={**body, "stream": False}, timeout=60)
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=60) as response:
        events = names(response.iter_bytes())
    usage = events[0][1]["message"]["usage"]
    assert usage["cache_read_input_tokens"] > 5 * CHUNK  # the first request's prefill
    end = next(data for name, data in events if name == "message_delta")["usage"]
    assert end["cache_read_input_tokens"] == usage["cache_read_input_tokens"]


def test_refusal_before_admission_keeps_its_status(server) -> None:
    body = message_body("refused", max_tokens=6)
    body["messages"][0]["content"] = "w " * 5000  # longer than the context
    response = httpx.post(server.url + "/v1/messages", json=body, timeout=60)
    assert response.status_code == 400
    assert "prompt is too long" in response.json()["error"]["message"]


def test_openai_stream_sends_the_role_chunk_at_admission_and_pings(server) -> None:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": long_prompt("openai-pings")}],
        "max_tokens": 6,
        "stream": True,
        "temperature": 0,
    }
    url = server.url + "/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[0].startswith("data: ")
    first = json.loads(lines[0].removeprefix("data: "))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = next(
        i
        for i, line in enumerate(lines)
        if line.startswith("data: {") and '"content":' in line and i > 0
    )
    assert lines[1:content].count(": ping") >= 2, lines[:content]
    assert lines[-1] == "data: [DONE]"


# -- a client that goes away mid-prefill --------------------------------------------------------


def raw_request(server: LiveServer, body: dict, api_key: str = "key-a") -> socket.socket:
    """A socket that sent a streaming request and read its stream up to message_start."""
    url = urlparse(server.url)
    payload = json.dumps(body).encode()
    request = (
        f"POST /v1/messages HTTP/1.1\r\nhost: {url.netloc}\r\nx-api-key: {api_key}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
    ).encode() + payload
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    sock.sendall(request)
    received = b""
    while b"message_start" not in received:
        chunk = sock.recv(65536)
        assert chunk, received
        received += chunk
    assert received.startswith(b"HTTP/1.1 200")
    assert b"content_block_delta" not in received
    return sock


def test_client_gone_mid_prefill_aborts_the_request(server) -> None:
    settle(server)
    before = stats(server)
    body = message_body("gone-mid-prefill", max_tokens=200)
    sock = raw_request(server, body)
    sock.close()
    settle(server)
    after = stats(server)
    assert after["blocks_in_use"] == 0
    assert after["requests_added"] == before["requests_added"] + 1
    # Had it been prefilled to the end, its ~20 full prompt blocks would all be cached.
    assert after["blocks_cached"] - before["blocks_cached"] < 15


# -- identical requests of one key attach to one run ----------------------------------------


async def read_stream(
    client: httpx.AsyncClient, body: dict, key: str, retry: bool = False
) -> list[tuple[str, dict]]:
    headers = {"x-api-key": key} | ({"x-stainless-retry-count": "1"} if retry else {})
    async with client.stream("POST", "/v1/messages", json=body, headers=headers) as response:
        assert response.status_code == 200
        return [
            (e.name.decode() if e.name else "", json.loads(e.data))
            async for e in sse.aevents(response.aiter_bytes())
            if e.data is not None
        ]


def text(events: list[tuple[str, dict]]) -> str:
    return "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta")


async def two_at_once(
    server: LiveServer, body: dict, keys: tuple[str, str], retry: bool = False
) -> list[list]:
    """The first request up to message_start, then the second; both read to their end."""
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        headers = {"x-api-key": keys[0]}
        async with client.stream("POST", "/v1/messages", json=body, headers=headers) as first:
            events = sse.aevents(first.aiter_bytes())
            head = [e async for e in _until(events, b"message_start")]
            second = asyncio.create_task(read_stream(client, body, keys[1], retry))
            rest = [e async for e in events]
        parsed = [
            (e.name.decode() if e.name else "", json.loads(e.data))
            for e in head + rest
            if e.data is not None
        ]
        return [parsed, await second]


async def _until(events, name: bytes):
    async for event in events:
        yield event
        if event.name == name:
            return


def test_identical_requests_of_one_key_cost_one_engine_request(server) -> None:
    settle(server)
    before = engine_requests(server)
    body = message_body("attached")
    first, second = asyncio.run(two_at_once(server, body, ("key-a", "key-a")))
    assert first[-1][0] == second[-1][0] == "message_stop"
    assert text(first) == text(second) and text(first)
    assert first[0][1]["message"]["id"] == second[0][1]["message"]["id"]  # the same run
    settle(server)
    assert engine_requests(server) == before + 1


def test_identical_non_streaming_requests_attach_too(server) -> None:
    settle(server)
    before = engine_requests(server)
    body = message_body("attached-whole", stream=False)

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            headers = {"x-api-key": "key-a"}
            jobs = [client.post("/v1/messages", json=body, headers=headers) for _ in range(2)]
            return await asyncio.gather(*jobs)

    responses = asyncio.run(both())
    assert [r.status_code for r in responses] == [200, 200]
    assert responses[0].json() == responses[1].json()
    settle(server)
    assert engine_requests(server) == before + 1


def test_two_keys_are_never_attached(server) -> None:
    settle(server)
    before = engine_requests(server)
    body = message_body("two-keys")
    first, second = asyncio.run(two_at_once(server, body, ("key-a", "key-b")))
    assert first[-1][0] == second[-1][0] == "message_stop"
    assert first[0][1]["message"]["id"] != second[0][1]["message"]["id"]
    settle(server)
    assert engine_requests(server) == before + 2


def test_sampled_requests_are_not_attached_unless_retried(server) -> None:
    settle(server)
    before = engine_requests(server)
    body = message_body("sampled", temperature=1.0)
    asyncio.run(two_at_once(server, body, ("key-a", "key-a")))
    settle(server)
    assert engine_requests(server) == before + 2


def test_first_caller_gone_does_not_cancel_an_attached_one(server) -> None:
    settle(server)
    before = engine_requests(server)
    body = message_body("first-gone", max_tokens=8)
    sock = raw_request(server, body)
    same = json.dumps(body).encode()  # the body's bytes are the key: a retry resends them

    async def follow() -> list[tuple[str, dict]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            headers = {"x-api-key": "key-a", "content-type": "application/json"}
            post = client.stream("POST", "/v1/messages", content=same, headers=headers)
            async with post as r:
                events = sse.aevents(r.aiter_bytes())
                head = [e async for e in _until(events, b"message_start")]
                sock.close()  # the first caller goes; the second still listens
                rest = [e async for e in events]
        return [
            (e.name.decode() if e.name else "", json.loads(e.data))
            for e in head + rest
            if e.data is not None
        ]

    events = asyncio.run(follow())
    assert events[-1][0] == "message_stop"
    assert not any(name == "error" for name, _ in events)
    delta = next(data for name, data in events if name == "message_delta")
    assert delta["usage"]["output_tokens"] == 8
    settle(server)
    assert engine_requests(server) == before + 1


def test_a_retried_sampled_request_attaches(server) -> None:
    settle(server)
    before = engine_requests(server)
    body = message_body("sampled-retry", temperature=1.0)
    first, second = asyncio.run(two_at_once(server, body, ("key-a", "key-a"), retry=True))
    assert text(first) == text(second)
    settle(server)
    assert engine_requests(server) == before + 1


def test_openai_identical_seeded_requests_attach(server) -> None:
    settle(server)
    before = engine_requests(server)
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": long_prompt("openai-attached")}],
        "max_tokens": 6,
        "stream": True,
        "seed": 7,
    }

    async def both() -> list[list[str]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.gather(*(lines(client) for _ in range(2)))

    async def lines(client: httpx.AsyncClient) -> list[str]:
        headers = {"authorization": "Bearer key-a"}
        post = client.stream("POST", "/v1/chat/completions", json=body, headers=headers)
        async with post as response:
            return [line async for line in response.aiter_lines() if line.startswith("data:")]

    first, second = asyncio.run(both())
    assert first == second and first[-1] == "data: [DONE]"
    settle(server)
    assert engine_requests(server) == before + 1


def test_a_request_resent_after_its_caller_left_gets_its_own_answer(server) -> None:
    """A request whose only caller has gone is being aborted: the same request sent again
    (the client's retry after a timeout) is not attached to it but answered in full."""
    settle(server)
    body = message_body("left-then-resent", max_tokens=8)
    raw_request(server, body).close()  # the caller goes once the stream has started
    with httpx.stream(
        "POST",
        server.url + "/v1/messages",
        content=json.dumps(body).encode(),
        headers={"x-api-key": "key-a", "content-type": "application/json"},
        timeout=60,
    ) as response:
        events = [(e.name, json.loads(e.data)) for e in sse.events(response.iter_bytes())
                  if e.data is not None]  # fmt: skip
    assert events[-1][0] == b"message_stop", events
    delta = next(data for name, data in events if name == b"message_delta")
    assert delta["usage"]["output_tokens"] == 8


def test_openai_streams_wait_longer_before_a_ping_by_default() -> None:
    """Chat and Completions ping after 30 s of silence, Messages and Responses after 5 s: the
    OpenAI API never writes a comment there, and vLLM's `bench serve` reads a stream whose
    comment arrived alone as one chunk at its end (keepalive.py)."""
    from zerohop.api.serving.service import ServingContext
    from zerohop.cli import build_parser

    args = build_parser().parse_args(["serve", "tiny"])
    assert (args.stream_ping_interval, args.openai_ping_interval) == (5.0, 30.0)
    fields = ServingContext.__dataclass_fields__
    assert fields["openai_ping_interval"].default == args.openai_ping_interval
    assert fields["ping_interval"].default == args.stream_ping_interval
