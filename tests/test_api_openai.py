"""The OpenAI API surface on a live server, driven by the official `openai` SDK and httpx."""

from __future__ import annotations

import asyncio
import math
import socket
import time
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import httpx
import msgspec
import openai
import orjson
import pytest

from tests.live_server import MODEL_NAME, LiveServer
from tests.scripted_engine import scripted_generation
from zerohop import LLM, SamplingParams, sse
from zerohop.api.errors import ApiError
from zerohop.api.generation.sse import send_stream
from zerohop.api.openai import schema as openai_schema
from zerohop.api.openai.output import LogprobFormatter
from zerohop.api.openai.stream import ChatStream
from zerohop.engine.base.outputs import RequestDelta
from zerohop.engine.llm import RequestOutput
from zerohop.engine.text.tokenizer import Tokenizer

CHAT = [{"role": "user", "content": "Tell me about the quick brown fox."}]
PROMPT = "The quick brown fox jumps over"
MAX = 12


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(llama_dir, num_kv_blocks=256)


def offline(llm: LLM, prompt_ids: list[int], **params: object) -> RequestOutput:
    options = {"temperature": 0, "max_tokens": MAX, **params}
    return llm.generate(prompt_ids, SamplingParams(**options))[0]


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="any", max_retries=0)


def async_client(server: LiveServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="any", max_retries=0)


def check_usage(usage: object, prompt_tokens: int, out: RequestOutput) -> None:
    assert usage.prompt_tokens == prompt_tokens
    assert usage.completion_tokens == len(out.token_ids)
    assert usage.total_tokens == prompt_tokens + len(out.token_ids)
    assert usage.prompt_tokens_details.cached_tokens >= 0


# -- chat completions -------------------------------------------------------------------------


def test_chat_matches_offline_greedy(live_server: LiveServer, llm: LLM) -> None:
    ids = llm.tokenizer.encode_chat(CHAT)
    want = offline(llm, ids)
    got = client(live_server).chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=MAX, temperature=0
    )
    assert got.id.startswith("chatcmpl-") and got.object == "chat.completion"
    assert got.model == MODEL_NAME
    choice = got.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == want.text
    assert choice.finish_reason == want.finish_reason
    assert choice.logprobs is None
    check_usage(got.usage, len(ids), want)


def test_chat_stream_with_usage(live_server: LiveServer, llm: LLM) -> None:
    ids = llm.tokenizer.encode_chat(CHAT)
    want = offline(llm, ids)
    stream = client(live_server).chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_completion_tokens=MAX,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert chunks[-2].choices[0].finish_reason == want.finish_reason
    assert chunks[-1].choices == []
    assert all(c.usage is None for c in chunks[:-1])
    check_usage(chunks[-1].usage, len(ids), want)
    # role chunk + one chunk per token + finish chunk + usage chunk
    assert len(chunks) == 3 + len(want.token_ids), "each token arrives as its own chunk"


def test_chat_async_stream_and_not_concurrently(live_server: LiveServer, llm: LLM) -> None:
    """Content parts and the developer role (rendered as system) through the async SDK."""
    messages = [
        {"role": "developer", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "!"}],
        },
    ]
    rendered = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi !"}]
    want = offline(llm, llm.tokenizer.encode_chat(rendered))

    async def run() -> tuple[str, str]:
        sdk = async_client(live_server)
        args = {"model": MODEL_NAME, "messages": messages, "max_tokens": MAX, "temperature": 0}

        async def streamed() -> str:
            stream = await sdk.chat.completions.create(**args, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream])

        async def whole() -> str:
            return (await sdk.chat.completions.create(**args)).choices[0].message.content

        try:
            return await asyncio.gather(streamed(), whole())
        finally:
            await sdk.close()

    assert asyncio.run(run()) == [want.text, want.text]


def test_chat_logprobs_match_offline(live_server: LiveServer, llm: LLM) -> None:
    ids = llm.tokenizer.encode_chat(CHAT)
    want = offline(llm, ids, logprobs=3)
    sdk = client(live_server)
    args = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": MAX, "temperature": 0}
    got = sdk.chat.completions.create(**args, logprobs=True, top_logprobs=3)
    content = got.choices[0].logprobs.content
    assert len(content) == len(want.token_ids) == got.usage.completion_tokens
    for entry, token_id, candidates in zip(content, want.token_ids, want.logprobs, strict=True):
        assert math.isclose(entry.logprob, candidates[token_id], abs_tol=1e-4)
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the top token
        assert math.isclose(tops[0], entry.logprob, abs_tol=1e-6)
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    joined = b"".join(bytes(e.bytes) for e in content)
    assert joined.decode("utf-8", "replace") == got.choices[0].message.content

    stream = sdk.chat.completions.create(**args, logprobs=True, top_logprobs=3, stream=True)
    streamed = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]


def test_chat_stop_string_and_seed(live_server: LiveServer, llm: LLM) -> None:
    ids = llm.tokenizer.encode_chat(CHAT)
    full = offline(llm, ids).text
    stop = full[4:6]
    want = offline(llm, ids, stop=[stop])
    sdk = client(live_server)
    args = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": MAX}
    got = sdk.chat.completions.create(**args, temperature=0, stop=stop).choices[0]
    assert (got.message.content, got.finish_reason) == (want.text, "stop")
    assert stop not in got.message.content
    seeded = [sdk.chat.completions.create(**args, temperature=1.0, seed=7) for _ in range(2)]
    assert seeded[0].choices[0].message.content == seeded[1].choices[0].message.content


def test_repeated_long_prompt_reports_cached_tokens(live_server: LiveServer) -> None:
    messages = [{"role": "user", "content": "cache me please " * 40}]
    sdk = client(live_server)
    args = {"model": MODEL_NAME, "messages": messages, "max_tokens": 2, "temperature": 0}
    sdk.chat.completions.create(**args)
    usage = sdk.chat.completions.create(**args).usage
    assert 0 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens


# -- completions ------------------------------------------------------------------------------


def test_completions_match_offline(live_server: LiveServer, llm: LLM) -> None:
    ids = llm.tokenizer.encode(PROMPT)
    want = offline(llm, ids)
    sdk = client(live_server)
    got = sdk.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=MAX, temperature=0)
    assert got.id.startswith("cmpl-") and got.object == "text_completion"
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    check_usage(got.usage, len(ids), want)
    by_ids = sdk.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=MAX, temperature=0)
    assert by_ids.choices[0].text == want.text
    echoed = sdk.completions.create(
        model=MODEL_NAME, prompt=[PROMPT], max_tokens=MAX, temperature=0, echo=True
    )
    assert echoed.choices[0].text == PROMPT + want.text


def test_completions_default_max_tokens_is_16(live_server: LiveServer) -> None:
    got = client(live_server).completions.create(
        model=MODEL_NAME, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got.usage.completion_tokens == 16 and got.choices[0].finish_reason == "length"


# -- explicit nulls: as if absent ----------------------------------------------------------

# The smallest valid body of each Struct, to which each optional field is added as null.
MINIMAL = {
    openai_schema.ChatRequest: {"model": MODEL_NAME, "messages": CHAT},
    openai_schema.CompletionRequest: {"model": MODEL_NAME, "prompt": PROMPT},
    openai_schema.Message: {"role": "user"},
    openai_schema.ContentPart: {"type": "text"},
    openai_schema.StreamOptions: {},
}


def optional_fields(kind: type) -> list[str]:
    return [f.name for f in msgspec.structs.fields(kind) if f.required is False]


def all_null(kind: type, **values: object) -> dict:
    return {**MINIMAL[kind], **dict.fromkeys(optional_fields(kind)), **values}


@pytest.mark.parametrize("kind", list(MINIMAL), ids=lambda kind: kind.__name__)
def test_every_optional_field_takes_null_as_absent(kind: type) -> None:
    absent = openai_schema.decode(orjson.dumps(MINIMAL[kind]), kind)
    for name in optional_fields(kind):
        body = orjson.dumps({**MINIMAL[kind], name: None})
        assert openai_schema.decode(body, kind) == absent, name


@pytest.mark.parametrize("name", ["model", "prompt"])
def test_a_required_field_sent_as_null_is_missing(live_server: LiveServer, name: str) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPT, name: None}
    response = httpx.post(live_server.url + "/v1/completions", json=body)
    error = check_error(response, 400, name)
    assert error["message"] == f"Missing required parameter: '{name}'."


def test_completions_null_max_tokens_is_16(live_server: LiveServer) -> None:
    # Every optional field null but ignore_eos: the defaults, so 16 tokens (was: to the end
    # of the context).
    body = all_null(openai_schema.CompletionRequest, ignore_eos=True)
    response = httpx.post(live_server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    got = response.json()
    assert got["usage"]["completion_tokens"] == 16
    assert got["choices"][0]["finish_reason"] == "length"
    assert got["object"] == "text_completion"  # stream: null is not a stream


def test_chat_nulls_are_the_defaults(live_server: LiveServer) -> None:
    body = all_null(openai_schema.ChatRequest, max_completion_tokens=3)
    response = httpx.post(live_server.url + CHAT_PATH, json=body, timeout=60)
    assert response.status_code == 200, response.text
    got = response.json()
    assert got["object"] == "chat.completion" and got["choices"][0]["logprobs"] is None
    assert 1 <= got["usage"]["completion_tokens"] <= 3
    # max_completion_tokens null too: max_tokens decides; both null: the rest of the context.
    body = all_null(openai_schema.ChatRequest, max_tokens=2)
    assert (
        httpx.post(live_server.url + CHAT_PATH, json=body).json()["usage"]["completion_tokens"] <= 2
    )


def test_sdk_none_arguments_are_the_defaults(live_server: LiveServer) -> None:
    # The SDK sends an argument given as None as an explicit null.
    sdk = client(live_server)
    nulls = {"temperature": None, "top_p": None, "stop": None, "seed": None, "user": None}
    got = sdk.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=None,
        logprobs=None,
        echo=None,
        stream_options=None,
        extra_body={"ignore_eos": True},
        **nulls,
    )
    assert got.usage.completion_tokens == 16
    chat = sdk.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_tokens=None,
        max_completion_tokens=2,
        logprobs=None,
        top_logprobs=None,
        metadata=None,
        stream_options=None,
        **nulls,
    )
    assert 1 <= chat.usage.completion_tokens <= 2


def test_completions_async_stream_with_usage(live_server: LiveServer, llm: LLM) -> None:
    ids = llm.tokenizer.encode(PROMPT)
    want = offline(llm, ids)

    async def run() -> list:
        sdk = async_client(live_server)
        try:
            stream = await sdk.completions.create(
                model=MODEL_NAME,
                prompt=PROMPT,
                max_tokens=MAX,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            return [c async for c in stream]
        finally:
            await sdk.close()

    chunks = asyncio.run(run())
    assert len(chunks) == 2 + len(want.token_ids), "each token arrives as its own chunk"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-2].choices[0].finish_reason == want.finish_reason
    assert chunks[-1].choices == []
    check_usage(chunks[-1].usage, len(ids), want)


def test_completions_legacy_logprobs(live_server: LiveServer, llm: LLM) -> None:
    ids = llm.tokenizer.encode(PROMPT)
    want = offline(llm, ids, logprobs=2)
    sdk = client(live_server)
    args = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": MAX, "temperature": 0}
    got = sdk.completions.create(**args, logprobs=2).choices[0].logprobs
    n = len(want.token_ids)
    assert len(got.tokens) == len(got.token_logprobs) == len(got.top_logprobs) == n
    columns = zip(got.token_logprobs, want.token_ids, want.logprobs, strict=True)
    for lp, token_id, candidates in columns:
        assert math.isclose(lp, candidates[token_id], abs_tol=1e-4)
    for token, lp, top in zip(got.tokens, got.token_logprobs, got.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3 and math.isclose(max(top.values()), lp, abs_tol=1e-6)
        assert top[token] == max(top.values())
    assert got.text_offset[0] == 0 and got.text_offset == sorted(got.text_offset)

    stream = sdk.completions.create(**args, logprobs=2, stream=True)
    chunks = [c.choices[0].logprobs for c in stream if c.choices[0].logprobs]
    offsets = [o for logprobs in chunks for o in logprobs.text_offset]
    assert offsets == got.text_offset


# -- models and transport ---------------------------------------------------------------------


def test_models(live_server: LiveServer) -> None:
    sdk = client(live_server)
    listed = sdk.models.list().data
    assert [(m.id, m.object, m.owned_by) for m in listed] == [(MODEL_NAME, "model", "zerohop")]
    assert sdk.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.models.retrieve("no-such-model")
    assert missing.value.code == "model_not_found"
    assert "no-such-model" in missing.value.message


def test_http2_h2c(live_server: LiveServer, llm: LLM) -> None:
    want = offline(llm, llm.tokenizer.encode_chat(CHAT))
    body = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": MAX, "temperature": 0}
    with httpx.Client(base_url=live_server.url, http1=False, http2=True) as h2:
        response = h2.post("/v1/chat/completions", json=body)
        assert response.http_version == "HTTP/2" and response.status_code == 200
        assert response.headers["request-id"] == response.headers["x-request-id"]
        assert response.json()["choices"][0]["message"]["content"] == want.text
        with h2.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as stream:
            assert stream.http_version == "HTTP/2"
            assert stream.headers["content-type"].startswith("text/event-stream")
            events = [
                e.data.decode() for e in sse.events(stream.iter_bytes()) if e.data is not None
            ]
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == want.text


# -- bad input --------------------------------------------------------------------------------

OK_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}
JSON = {"content-type": "application/json"}
CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
IMAGE = [{"type": "image_url", "image_url": {"url": "http://x"}}]
TOOLS = [{"type": "function", "function": {"name": "not a name"}}]  # bad: spaces
BAD_UTF8 = b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "\xff\xfe"}]}'


def chat(**fields: object) -> dict:
    return {**OK_CHAT, **fields}


def completion(**fields: object) -> dict:
    return {"model": MODEL_NAME, "prompt": "a", **fields}


# (id, body, status, param); chat unless the body has a prompt.
BAD = [
    ("malformed-json", b'{"model": "x", ', 400, None),
    ("not-an-object", b"[1, 2]", 400, None),
    ("wrong-type", chat(max_tokens="5"), 400, "max_tokens"),
    ("wrong-messages-type", chat(messages="hi"), 400, "messages"),
    ("missing-messages", {"model": MODEL_NAME}, 400, "messages"),
    ("missing-model", {"messages": OK_CHAT["messages"]}, 400, "model"),
    ("empty-messages", chat(messages=[]), 400, "messages"),
    ("unknown-field", chat(max_tokenz=5), 400, "max_tokenz"),
    ("bad-role", chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role"),
    (
        "image-part",
        chat(messages=[{"role": "user", "content": IMAGE}]),
        400,
        "messages[0].content[0]",
    ),
    ("n-0", chat(n=0), 400, "n"),
    ("n-129", completion(n=129), 400, "n"),
    ("tools", chat(tools=TOOLS), 400, "tools"),
    ("top-logprobs-range", chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("top-logprobs-alone", chat(top_logprobs=2), 400, "top_logprobs"),
    ("temperature-range", chat(temperature=2.5), 400, "temperature"),
    ("stream-options-alone", chat(stream_options={"include_usage": True}), 400, "stream_options"),
    ("max-tokens-zero", chat(max_tokens=0), 400, None),
    ("max-tokens-beyond-context", chat(max_tokens=100_000), 400, "max_tokens"),
    ("prompt-beyond-context", completion(prompt=list(range(5, 505)) * 5), 400, None),
    ("unknown-model", chat(model="gpt-4o"), 404, "model"),
    ("invalid-utf8", BAD_UTF8, 400, None),
    ("batch-prompts", completion(prompt=["a", "b"]), 400, "prompt"),
    ("empty-token-prompt", completion(prompt=[]), 400, "prompt"),
    ("token-out-of-vocab", completion(prompt=[1, 10**6]), 400, "prompt"),
    ("legacy-logprobs-range", completion(logprobs=6), 400, "logprobs"),
    ("best-of", completion(best_of=3), 400, "best_of"),
]


def _encode(body: object) -> bytes:
    return body if isinstance(body, bytes) else orjson.dumps(body)


def check_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.headers["request-id"] == response.headers["x-request-id"]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    kinds = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error"}
    assert error["type"] == kinds.get(status, "invalid_request_error")
    assert error["param"] == param
    return error


def still_serves(url: str) -> None:
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}
    assert httpx.post(url + "/v1/completions", json=body).json()["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize(("body", "status", "param"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input(live_server: LiveServer, body: object, status: int, param: str | None) -> None:
    path = COMPLETIONS_PATH if isinstance(body, dict) and "prompt" in body else CHAT_PATH
    response = httpx.post(live_server.url + path, content=_encode(body), headers=JSON)
    check_error(response, status, param)
    still_serves(live_server.url)


@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded"])
def test_unsupported_content_type_is_415(live_server: LiveServer, kind: str) -> None:
    body = _encode(OK_CHAT)
    response = httpx.post(live_server.url + CHAT_PATH, content=body, headers={"content-type": kind})
    check_error(response, 415)
    still_serves(live_server.url)


def test_context_errors_carry_the_numbers(live_server: LiveServer) -> None:
    too_long = {"model": MODEL_NAME, "prompt": list(range(5, 505)) * 5, "max_tokens": 1}
    error = check_error(httpx.post(live_server.url + "/v1/completions", json=too_long), 400)
    assert "2500" in error["message"] and "2048" in error["message"]
    too_many = {**OK_CHAT, "max_tokens": 5000}
    response = httpx.post(live_server.url + CHAT_PATH, json=too_many)
    error = check_error(response, 400, "max_tokens")
    assert "5000" in error["message"] and "2048" in error["message"]


def test_body_over_limit_is_413(live_server: LiveServer) -> None:
    body = b'{"model": "tiny-llama", "prompt": "' + b"a" * (32 * 2**20) + b'"}'
    response = httpx.post(
        live_server.url + COMPLETIONS_PATH, content=body, headers=JSON, timeout=60
    )
    check_error(response, 413)
    still_serves(live_server.url)


def test_sdk_raises_typed_errors(live_server: LiveServer) -> None:
    sdk = client(live_server)
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.chat.completions.create(model=MODEL_NAME, messages=OK_CHAT["messages"], n=0)
    assert bad.value.param == "n"
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.chat.completions.create(model="gpt-4o", messages=OK_CHAT["messages"])
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        sdk.completions.create(model="gpt-4o", prompt="hi")


def test_neutral_unsupported_parameters_are_accepted(live_server: LiveServer) -> None:
    got = client(live_server).chat.completions.create(
        model=MODEL_NAME,
        messages=OK_CHAT["messages"],
        max_tokens=2,
        user="someone",
        metadata={"k": "v"},
        presence_penalty=0,
        frequency_penalty=0,
        response_format={"type": "text"},
        extra_body={"top_k": 5, "tools": []},
    )
    assert got.usage.completion_tokens >= 1


# -- disconnects ------------------------------------------------------------------------------

LONG = {**OK_CHAT, "max_tokens": 1900, "ignore_eos": True, "stream": True}


def engine_stats(url: str) -> dict:
    return httpx.get(url + "/engine/stats").json()


def settled_stats(url: str) -> dict:
    """The engine's counters once nothing runs (an abort lands at its next step)."""
    for _ in range(200):
        stats = engine_stats(url)
        if stats["num_running"] == 0 and stats["num_waiting"] == 0:
            return stats
        time.sleep(0.02)
    return stats


def check_aborted(url: str, before: dict) -> None:
    after = settled_stats(url)
    assert after["num_running"] == 0 and after["blocks_in_use"] == 0
    # Had it run to its 1900 tokens, ~119 more blocks would have been filled and cached.
    assert after["blocks_cached"] - before["blocks_cached"] < 40


def test_disconnect_mid_stream_aborts_the_request(live_server: LiveServer) -> None:
    before = settled_stats(live_server.url)
    with httpx.Client() as http:  # noqa: SIM117 - the connection must close mid-stream
        with http.stream("POST", live_server.url + CHAT_PATH, json=LONG) as response:
            lines = response.iter_lines()
            assert [next(lines) for _ in range(6)][4].startswith("data: ")
            assert engine_stats(live_server.url)["num_running"] == 1
    check_aborted(live_server.url, before)


def test_http2_stream_reset_aborts_the_request(live_server: LiveServer) -> None:
    before = settled_stats(live_server.url)
    body = orjson.dumps(LONG)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    with socket.create_connection(("127.0.0.1", live_server.port)) as sock:
        conn.initiate_connection()
        headers = [(":method", "POST"), (":path", CHAT_PATH), (":scheme", "http")]
        headers += [(":authority", "localhost"), ("content-type", "application/json")]
        conn.send_headers(1, headers)
        conn.send_data(1, body, end_stream=True)
        sock.sendall(conn.data_to_send())
        received = 0
        while received < 3:
            for event in conn.receive_data(sock.recv(65536)):
                if isinstance(event, h2.events.DataReceived):
                    received += 1
                    conn.acknowledge_received_data(event.flow_controlled_length, 1)
            sock.sendall(conn.data_to_send())
        assert engine_stats(live_server.url)["num_running"] == 1
        conn.reset_stream(1)
        sock.sendall(conn.data_to_send())
        check_aborted(live_server.url, before)


# -- mid-stream failures (no request fails on demand in a healthy engine: framing tested directly)


def _stream_bytes(llama_dir: Path, deltas: list[RequestDelta | Exception]) -> list[bytes]:
    tokenizer = Tokenizer.from_dir(llama_dir)
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    generation = scripted_generation(tokenizer, deltas)
    stream = ChatStream(
        "req_x", "chatcmpl-x", MODEL_NAME, False, LogprobFormatter(tokenizer), top=None
    )
    asyncio.run(send_stream(generation, stream, send, []))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert sent[-1]["more_body"] is False
    return b"".join(m.get("body", b"") for m in sent[1:]).split(b"\n\n")


@pytest.mark.parametrize(
    "failure",
    [
        RequestDelta("r", [7], "", finished=True, finish_reason="error", error="sampling failed"),
        ApiError(500, "the engine failed: gone"),
    ],
    ids=["engine-error-delta", "engine-died"],
)
def test_mid_stream_failure_sends_an_error_chunk(llama_dir: Path, failure: object) -> None:
    events = _stream_bytes(llama_dir, [RequestDelta("r", [5], "Hi"), failure])
    role, content, error, done, rest = events
    assert b'"role":"assistant"' in role and b'"content":"Hi"' in content
    body = orjson.loads(error.removeprefix(b"data: "))
    assert body["error"]["type"] == "server_error" and body["error"]["message"]
    assert (done, rest) == (b"data: [DONE]", b"")
