"""The Anthropic Messages API against a live server: the official SDK, raw SSE, h2c, errors."""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import time
from pathlib import Path
from urllib.parse import urlparse

import anthropic
import httpx
import msgspec
import pytest

from tests.live_server import MODEL_NAME, LiveServer
from zerohop import LLM, SamplingParams, sse
from zerohop.api.anthropic import schema as anthropic_schema

QUESTION = "Tell me a story about a lighthouse keeper."
STREAM_EVENTS_ORDER = ["message_start", "content_block_start", "ping"]
STREAM_EVENTS_END = ["content_block_stop", "message_delta", "message_stop"]
SLOW_BODY_LIMIT = 65536
# anthropic 2.x has no sampling kwargs; the API still takes them in the body.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def offline(llama_dir: Path) -> LLM:
    return LLM(llama_dir, num_kv_blocks=256)


@pytest.fixture(scope="module")
def expected(offline: LLM):
    """Greedy offline result for a chat prompt: (prompt ids, output)."""

    def run(messages: list[dict], max_tokens: int = 8):
        prompt = offline.tokenizer.encode_chat(messages)
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        return prompt, offline.generate(prompt, params)[0]

    return run


@pytest.fixture(scope="module")
def slow_server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A server whose engine sleeps 0.25 s after each step, with a small body limit."""
    log = tmp_path_factory.mktemp("slow_server") / "server.log"
    args = ["--debug-step-delay", "0.25", "--max-body-bytes", str(SLOW_BODY_LIMIT)]
    server = LiveServer(llama_dir, extra_args=[*args, "--grpc-port", "0"]).start(log)
    yield server
    server.stop()


def client(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="test-key", max_retries=0)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def check_usage(usage, prompt: list[int], output_tokens: int) -> None:
    assert usage.input_tokens + usage.cache_read_input_tokens == len(prompt)
    assert usage.cache_creation_input_tokens == 0
    assert usage.output_tokens == output_tokens


def test_sdk_create_matches_offline_greedy(live_server, expected) -> None:
    prompt, want = expected(user(QUESTION))
    message = client(live_server).messages.create(
        model=MODEL_NAME, max_tokens=8, extra_body=GREEDY, messages=user(QUESTION)
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == MODEL_NAME
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == want.text
    assert message.stop_reason == ("max_tokens" if want.finish_reason == "length" else "end_turn")
    assert message.stop_sequence is None
    check_usage(message.usage, prompt, len(want.token_ids))


def test_sdk_stream_helper_matches_offline(live_server, expected) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Sing."},
    ]
    system = [{"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}]
    with client(live_server).messages.stream(
        model=MODEL_NAME, max_tokens=6, extra_body=GREEDY, system=system, messages=messages
    ) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    # The system blocks are concatenated as they are.
    plain = [{"role": "system", "content": "You are terse."}, *user("Hello"), *messages[1:]]
    prompt, want = expected(plain, 6)
    assert "".join(pieces) == want.text == final.content[0].text
    assert final.stop_reason == "max_tokens"
    check_usage(final.usage, prompt, len(want.token_ids))


def test_async_sdk_stream_and_create(live_server, expected) -> None:
    prompt, want = expected(user("Why is the sky blue?"), 5)

    async def main() -> tuple:
        async with anthropic.AsyncAnthropic(
            base_url=live_server.url, api_key="k", max_retries=0
        ) as aclient:
            kwargs = dict(model=MODEL_NAME, max_tokens=5, extra_body=GREEDY)
            events = [
                e
                async for e in await aclient.messages.create(
                    **kwargs, messages=user("Why is the sky blue?"), stream=True
                )
            ]
            whole = await aclient.messages.create(**kwargs, messages=user("Why is the sky blue?"))
            return events, whole

    events, whole = asyncio.run(main())
    types = [e.type for e in events]
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == STREAM_EVENTS_END
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == want.text == whole.content[0].text
    assert events[-2].delta.stop_reason == whole.stop_reason == "max_tokens"
    assert events[-2].usage.output_tokens == whole.usage.output_tokens == len(want.token_ids)
    check_usage(whole.usage, prompt, len(want.token_ids))


def test_consecutive_turns_are_merged(live_server, expected) -> None:
    split = [{"role": "user", "content": "First part."}, {"role": "user", "content": "Second."}]
    prompt, want = expected(user("First part.\n\nSecond."), 5)
    message = client(live_server).messages.create(
        model=MODEL_NAME, max_tokens=5, extra_body=GREEDY, messages=split
    )
    assert message.content[0].text == want.text
    check_usage(message.usage, prompt, len(want.token_ids))


def test_assistant_prefill_continues(live_server, offline) -> None:
    messages = [*user("Name a colour."), {"role": "assistant", "content": "My answer is"}]
    text = offline.tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True)
    prompt = offline.tokenizer.encode(text + "My answer is", add_special_tokens=False)
    want = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=5))[0]
    message = client(live_server).messages.create(
        model=MODEL_NAME, max_tokens=5, extra_body=GREEDY, messages=messages
    )
    assert message.content[0].text == want.text
    check_usage(message.usage, prompt, len(want.token_ids))


def test_stop_sequence(live_server, expected) -> None:
    _, want = expected(user("Hello there"), 12)
    stop = next(want.text[i : i + 2] for i in range(3, len(want.text)) if want.text[i].strip())
    message = client(live_server).messages.create(
        model=MODEL_NAME, max_tokens=12, extra_body=GREEDY, messages=user("Hello there"),
        stop_sequences=["never-generated-zzz", stop],
    )  # fmt: skip
    assert message.stop_reason == "stop_sequence"
    assert message.stop_sequence == stop
    assert message.content[0].text == want.text[: want.text.find(stop)]


def test_repeated_long_prompt_reads_the_cache(live_server, offline) -> None:
    long = " ".join(f"fact {i}: the lighthouse has {i} steps." for i in range(30))
    sdk = client(live_server)
    first = sdk.messages.create(model=MODEL_NAME, max_tokens=2, messages=user(long))
    second = sdk.messages.create(model=MODEL_NAME, max_tokens=2, messages=user(long))
    total = len(offline.tokenizer.encode_chat(user(long)))
    assert second.usage.cache_read_input_tokens > 0
    assert second.usage.cache_read_input_tokens > first.usage.cache_read_input_tokens
    for usage in (first.usage, second.usage):
        assert usage.input_tokens + usage.cache_read_input_tokens == total


def test_count_tokens(live_server, offline) -> None:
    messages = [*user("Count me."), {"role": "assistant", "content": "Sure."}, *user("Now.")]
    counted = client(live_server).messages.count_tokens(
        model=MODEL_NAME, system="Be brief.", messages=messages
    )
    want = offline.tokenizer.encode_chat([{"role": "system", "content": "Be brief."}, *messages])
    assert counted.input_tokens == len(want)


def sse_events(chunks) -> list[tuple[str, dict]]:
    return [
        (e.name and e.name.decode(), json.loads(e.data))
        for e in sse.events(chunks)
        if e.data is not None
    ]


def check_raw_stream(response: httpx.Response, want_text: str, prompt_len: int) -> None:
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["request-id"].startswith("req_")
    events = sse_events(response.iter_bytes())
    names = [name for name, _ in events]
    assert names[:3] == STREAM_EVENTS_ORDER and names[-3:] == STREAM_EVENTS_END
    assert set(names[3:-3]) == {"content_block_delta"}
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["id"] == "msg_" + response.headers["request-id"].removeprefix("req_")
    usage = start["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == prompt_len
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert all(d["type"] == "text_delta" for d in deltas)
    assert len(deltas) == 6, "one event per token (text may be held back for a partial char)"
    assert "".join(d["text"] for d in deltas) == want_text
    end = events[-2][1]
    assert end["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert end["usage"]["output_tokens"] == 6


def stream_body(text: str) -> dict:
    return {
        "model": MODEL_NAME, "max_tokens": 6, "temperature": 0, "stream": True,
        "messages": user(text),
    }  # fmt: skip


def test_raw_sse_event_order(live_server, expected) -> None:
    prompt, want = expected(user("Raw events."), 6)
    headers = {"x-api-key": "k", "anthropic-version": "2023-06-01"}
    with httpx.stream(
        "POST", live_server.url + "/v1/messages", json=stream_body("Raw events."), headers=headers
    ) as response:
        check_raw_stream(response, want.text, len(prompt))


def test_http2_prior_knowledge(live_server, expected) -> None:
    prompt, want = expected(user("Over h2c."), 6)
    body = {**stream_body("Over h2c."), "stream": False}
    with httpx.Client(http1=False, http2=True, base_url=live_server.url) as h2:
        whole = h2.post("/v1/messages", json=body, headers={"authorization": "Bearer k"})
        assert whole.http_version == "HTTP/2"
        assert whole.json()["content"][0]["text"] == want.text
        assert whole.headers["request-id"] == whole.json()["id"].replace("msg_", "req_")
        with h2.stream("POST", "/v1/messages", json=stream_body("Over h2c.")) as response:
            assert response.http_version == "HTTP/2"
            check_raw_stream(response, want.text, len(prompt))


def body(**fields) -> dict:
    return {"model": MODEL_NAME, "max_tokens": 4, "messages": user("hi"), **fields}


def encoded(**fields) -> bytes:
    return json.dumps(body(**fields)).encode()


JSON = {"content-type": "application/json"}
TOO_LONG = " ".join(f"word{i}" for i in range(1500))
BAD_REQUESTS = {
    "malformed json": (b'{"model": "tiny-llama", ', JSON, 400, "not valid JSON"),
    "not an object": (b"[1, 2]", JSON, 400, "request body is invalid"),
    "wrong type": (encoded(max_tokens="4"), JSON, 400, "max_tokens: Expected `int`"),
    "null max_tokens": (encoded(max_tokens=None), JSON, 400, "max_tokens: Field required"),
    "missing messages": (
        b'{"model": "tiny-llama", "max_tokens": 4}', JSON, 400, "messages: Field required",
    ),
    "unknown field": (encoded(foo=1), JSON, 400, "foo: Extra inputs are not permitted"),
    "unknown block field": (
        encoded(messages=[{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]),
        JSON, 400, "messages.0.content.0.x: Extra inputs are not permitted",
    ),
    "unsupported field": (encoded(mcp_servers=[]), JSON, 400, "mcp_servers: not supported"),
    "image block": (
        encoded(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
        JSON, 400, "messages.0.content.0: image blocks are not supported: this model takes text",
    ),
    "unknown block type": (
        encoded(messages=[{"role": "user", "content": [{"type": "hologram"}]}]),
        JSON, 400, "messages.0.content.0.type: 'hologram' content blocks are not supported",
    ),
    "unknown role in messages": (
        encoded(messages=[{"role": "narrator", "content": "a"}]), JSON, 400, "messages.0.role",
    ),
    "empty messages": (encoded(messages=[]), JSON, 400, "at least one message"),
    "empty content": (
        encoded(messages=[*user(""), *user("a")]), JSON, 400, "messages.0: all messages",
    ),
    "prefill with trailing space": (
        encoded(messages=[*user("a"), {"role": "assistant", "content": "b "}]),
        JSON, 400, "trailing whitespace",
    ),
    "temperature out of range": (encoded(temperature=1.5), JSON, 400, "temperature"),
    "max_tokens zero": (encoded(max_tokens=0), JSON, 400, "max_tokens"),
    "prompt too long": (
        encoded(messages=user(TOO_LONG)), JSON, 400, "tokens > 2047 maximum",
    ),
    "unknown model": (encoded(model="claude-opus-9"), JSON, 404, "model: claude-opus-9"),
    "form content type": (
        encoded(), {"content-type": "application/x-www-form-urlencoded"}, 415, "application/json",
    ),
    "latin-1 charset": (
        encoded(), {"content-type": "application/json; charset=latin-1"}, 415, "utf-8",
    ),
    "invalid utf-8": (
        b'{"model": "tiny-\xff", "max_tokens": 4, "messages": []}', JSON, 400, "UTF-8",
    ),
}  # fmt: skip
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 415: "invalid_request_error"}


def check_error(response: httpx.Response, status: int, error_type: str, text: str) -> None:
    assert response.status_code == status, response.text
    payload = response.json()
    assert payload["type"] == "error"
    assert payload["error"]["type"] == error_type
    assert text in payload["error"]["message"]
    assert payload["request_id"] == response.headers["request-id"]
    assert response.headers["x-request-id"] == response.headers["request-id"]


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request(live_server, case: str) -> None:
    content, headers, status, text = BAD_REQUESTS[case]
    response = httpx.post(live_server.url + "/v1/messages", content=content, headers=headers)
    check_error(response, status, ERROR_TYPES[status], text)


def test_bad_requests_leave_the_server_serving(live_server) -> None:
    url = live_server.url + "/v1/messages"
    for content, headers, _, _ in BAD_REQUESTS.values():
        httpx.post(url, content=content, headers=headers)
    count = httpx.post(url + "/count_tokens", json={"model": MODEL_NAME})
    check_error(count, 400, "invalid_request_error", "messages: Field required")
    assert httpx.post(url, json=body()).json()["usage"]["output_tokens"] == 4


# -- explicit nulls: as if absent ----------------------------------------------------------

# The smallest valid body of each Struct, to which each optional field is added as null.
MINIMAL = {
    anthropic_schema.MessagesRequest: body(),
    anthropic_schema.CountTokensRequest: {"model": MODEL_NAME, "messages": user("hi")},
    anthropic_schema.TextBlock: {"type": "text", "text": "hi"},
    anthropic_schema.Metadata: {},
}


def optional_fields(kind: type) -> list[str]:
    return [f.name for f in msgspec.structs.fields(kind) if f.required is False]


@pytest.mark.parametrize("kind", list(MINIMAL), ids=lambda kind: kind.__name__)
def test_every_optional_field_takes_null_as_absent(kind: type) -> None:
    decoder = msgspec.json.Decoder(kind)
    absent = decoder.decode(json.dumps(MINIMAL[kind]))
    for name in optional_fields(kind):
        assert decoder.decode(json.dumps({**MINIMAL[kind], name: None})) == absent, name


def test_nulls_are_the_defaults(live_server) -> None:
    kind = anthropic_schema.MessagesRequest
    nulls = {**MINIMAL[kind], **dict.fromkeys(optional_fields(kind))}
    response = httpx.post(live_server.url + "/v1/messages", json=nulls, timeout=60)
    assert response.status_code == 200, response.text  # stream: null is not a stream
    got = response.json()
    assert got["type"] == "message" and 1 <= got["usage"]["output_tokens"] <= 4
    count = {"model": MODEL_NAME, "messages": user("hi"), "system": None, "cache_control": None}
    counted = httpx.post(live_server.url + "/v1/messages/count_tokens", json=count)
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0


def test_sdk_none_arguments_are_the_defaults(live_server) -> None:
    # The SDK sends an argument given as None as an explicit null.
    got = client(live_server).messages.create(
        model=MODEL_NAME,
        max_tokens=3,
        messages=user("hi"),
        stop_sequences=None,
        metadata=None,
        system=None,
        cache_control=None,
        service_tier=None,
        speed=None,
        inference_geo=None,
        extra_body={"temperature": None, "top_p": None, "top_k": None},
    )
    assert 1 <= got.usage.output_tokens <= 3


def test_sdk_raises_typed_errors(live_server) -> None:
    sdk = client(live_server)
    with pytest.raises(anthropic.NotFoundError) as not_found:
        sdk.messages.create(model="nope", max_tokens=4, messages=user("hi"))
    assert not_found.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        sdk.messages.create(model=MODEL_NAME, max_tokens=4, messages=[])


def test_body_over_the_limit(slow_server) -> None:
    padding = "x" * (SLOW_BODY_LIMIT + 1000)
    response = httpx.post(slow_server.url + "/v1/messages", json=body(system=padding))
    check_error(response, 413, "request_too_large", str(SLOW_BODY_LIMIT))
    assert httpx.post(slow_server.url + "/v1/messages", json=body(max_tokens=1)).status_code == 200


def test_stream_is_incremental(slow_server) -> None:
    """With 0.25 s engine steps, each token's event arrives on its own, one step apart."""
    arrivals = []
    with httpx.stream(
        "POST", slow_server.url + "/v1/messages", json=stream_body("Slowly."), timeout=60
    ) as response:
        for event in sse.events(response.iter_bytes()):
            if (event.data or b"").startswith(b'{"type":"content_block_delta"'):
                arrivals.append(time.monotonic())
    assert len(arrivals) >= 5
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert min(gaps) > 0.1, gaps


def test_disconnect_mid_stream(slow_server) -> None:
    """The client goes away after the first token: the server aborts it and keeps serving."""
    url = urlparse(slow_server.url)
    payload = json.dumps({**stream_body("Long story."), "max_tokens": 400}).encode()
    request = (
        f"POST /v1/messages HTTP/1.1\r\nhost: {url.netloc}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
    ).encode() + payload
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(request)
        received = b""
        while b"content_block_delta" not in received:
            received += sock.recv(65536)
    assert received.startswith(b"HTTP/1.1 200")
    response = httpx.post(slow_server.url + "/v1/messages", json=body(max_tokens=2), timeout=60)
    assert response.status_code == 200
    assert response.json()["usage"]["output_tokens"] == 2
    assert httpx.get(slow_server.url + "/health").status_code == 200


def test_disconnect_frees_the_requests_blocks(llama_dir: Path) -> None:
    """The app on a real engine process, driven through ASGI: a client that goes away after
    the first token gets its request aborted, and the engine's blocks_in_use drops to 0."""
    from zerohop.api.serving.service import ServingContext
    from zerohop.app.routes import create_app
    from zerohop.engine.process.async_engine import AsyncEngine
    from zerohop.engine.text.tokenizer import Tokenizer

    payload = json.dumps({**stream_body("A very long story."), "max_tokens": 1500}).encode()
    scope = {
        "type": "http", "method": "POST", "path": "/v1/messages", "http_version": "1.1",
        "headers": [(b"content-type", b"application/json")],
    }  # fmt: skip

    async def main() -> tuple[int, int, list[bytes]]:
        engine = await AsyncEngine.start(
            str(llama_dir), num_kv_blocks=64, num_threads=1, step_delay=0.05
        )
        try:
            ctx = ServingContext(engine, Tokenizer.from_dir(llama_dir), MODEL_NAME, 2048)
            gone, requests, sent, in_use = asyncio.Event(), [payload], [], []

            async def receive() -> dict:
                if requests:
                    return {"type": "http.request", "body": requests.pop(), "more_body": False}
                await gone.wait()
                return {"type": "http.disconnect"}

            async def send(message: dict) -> None:
                sent.append(message.get("body", b""))
                if b"content_block_delta" in sent[-1] and not gone.is_set():
                    in_use.append((await engine.stats())["blocks_in_use"])
                    gone.set()

            await asyncio.wait_for(create_app(ctx)(scope, receive, send), 60)
            return in_use[0], (await engine.stats())["blocks_in_use"], sent
        finally:
            await engine.shutdown()

    during, after, sent = asyncio.run(main())
    assert during > 0
    assert after == 0
    assert not any(b"message_stop" in chunk for chunk in sent)  # it did not run to the end
