"""zerohop.client's own API and transports against one real replica (HTTP and gRPC), with
dead replicas beside it: answers equal the replica's own, failover before the first byte,
client errors returned at once, and the surfaces' continuation requests."""

from __future__ import annotations

import anthropic
import grpc
import httpx
import openai
import orjson
import pytest

from tests.live_server import MODEL_NAME, free_port
from zerohop.client import ApiStatusError, Client, ReplicaPool, http_client
from zerohop.client.surfaces import ChatCompletions, Completions, Messages, Responses
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2 as pb
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2_grpc as pb_grpc

QUESTION = [{"role": "user", "content": "What is the sea?"}]


def dead_url(scheme: str = "http") -> str:
    return f"{scheme}://127.0.0.1:{free_port()}"  # nothing listens there


@pytest.fixture
def direct(live_server):
    """What the replica answers when asked directly (no zerohop.client)."""
    body = {"model": MODEL_NAME, "max_tokens": 12, "temperature": 0, "messages": QUESTION}
    return httpx.post(live_server.url + "/v1/messages", json=body, timeout=60).json()


@pytest.mark.parametrize("scheme", ["http", "grpc"])
def test_sdks_through_the_transport_match_the_replica(live_server, direct, scheme) -> None:
    url = live_server.url if scheme == "http" else f"grpc://127.0.0.1:{live_server.grpc_port}"
    pool = ReplicaPool([url])
    try:
        http = http_client(pool=pool)
        claude = anthropic.Anthropic(base_url="http://zerohop", api_key="k", http_client=http)
        options = {"model": MODEL_NAME, "max_tokens": 12, "messages": QUESTION}
        message = claude.messages.create(**options, extra_body={"temperature": 0})
        assert message.content[0].text == direct["content"][0]["text"]
        assert message.usage.output_tokens == direct["usage"]["output_tokens"]
        with claude.messages.stream(**options, extra_body={"temperature": 0}) as stream:
            assert "".join(stream.text_stream) == direct["content"][0]["text"]
        gpt = openai.OpenAI(base_url="http://zerohop/v1", api_key="k", http_client=http)
        chunks = gpt.chat.completions.create(**options, temperature=0, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == direct["content"][0]["text"]
    finally:
        pool.close()
    assert pool.stats()[url]["requests"] == 3


def test_dead_replicas_are_skipped_before_the_first_byte(live_server, direct) -> None:
    dead = [dead_url(), dead_url("grpc")]
    client = Client([*dead, live_server.url], policy=None)
    try:
        for i in range(6):
            body = {"model": MODEL_NAME, "max_tokens": 12, "temperature": 0}
            message = client.messages(**body, messages=QUESTION)
            assert message["content"] == direct["content"], i
        stats = client.stats()
    finally:
        client.close()
    assert stats[live_server.url]["requests"] == 6
    for url in dead:
        # Each failed at most until its breaker opened (3 in a row), then was left alone.
        assert 1 <= stats[url]["failures"] <= 3 or stats[url]["requests"] == 0
        assert stats[url]["failures"] == stats[url]["failovers"]


def test_a_client_error_is_returned_at_once_not_retried(live_server) -> None:
    client = Client([live_server.url, dead_url()])
    try:
        with pytest.raises(ApiStatusError) as caught:
            client.messages(model=MODEL_NAME, max_tokens=0, messages=QUESTION)
        stats = client.stats()
    finally:
        client.close()
    assert caught.value.status == 400
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    # Tried on the live replica once (the dead one may have been tried first).
    assert stats[live_server.url]["requests"] == 1
    assert stats[live_server.url]["failures"] == 0


def test_own_api_streams_chat_completions_and_generate(live_server) -> None:
    grpc_url = f"grpc://127.0.0.1:{live_server.grpc_port}"
    client = Client([live_server.url, grpc_url])
    options = {"model": MODEL_NAME, "max_tokens": 10, "temperature": 0}
    try:
        chat = client.chat(**options, messages=QUESTION)
        chunks = list(client.stream_chat(**options, messages=QUESTION))
        streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert streamed == chat["choices"][0]["message"]["content"]
        completion = client.completions(**options, prompt="The sea is")
        replies = list(client.generate(model=MODEL_NAME, prompt="The sea is", max_tokens=10,
                                       temperature=0))  # fmt: skip
    finally:
        client.close()
    assert "".join(r.text for r in replies) == completion["choices"][0]["text"]
    assert replies[-1].usage.completion_tokens == completion["usage"]["completion_tokens"]
    with grpc.insecure_channel(f"127.0.0.1:{live_server.grpc_port}") as channel:
        request = pb.GenerateRequest(model=MODEL_NAME, prompt="The sea is", max_tokens=10,
                                     temperature=0)  # fmt: skip
        direct = list(pb_grpc.ZerohopStub(channel).Generate(request, timeout=60))
    assert [list(r.token_ids) for r in replies] == [list(r.token_ids) for r in direct]


@pytest.mark.parametrize(
    ("surface", "limit", "left"),
    [
        (Messages({"max_tokens": 10, "messages": QUESTION, "stream": True}), "max_tokens", 7),
        (
            ChatCompletions({"max_completion_tokens": 10, "stream": True}),
            "max_completion_tokens",
            7,
        ),
        (ChatCompletions({"stream": True}), None, None),
        (Completions({"prompt": "x", "stream": True, "echo": True}), "max_tokens", 13),
    ],
)
def test_a_continuation_asks_for_what_is_left(surface, limit, left) -> None:
    surface.token_ids = [5, 6, 7]
    body = surface.continuation()
    assert body["continue_token_ids"] == [5, 6, 7] and body["return_token_ids"] is True
    if limit is not None:
        assert body[limit] == left
    assert body.get("echo") in (None, False)


def test_a_continuation_with_nothing_left_ends_the_stream_itself() -> None:
    surface = Messages({"max_tokens": 3, "messages": QUESTION, "stream": True})
    surface.token_ids = [5, 6, 7]
    assert surface.continuation() is None
    assert b'"stop_reason":"max_tokens"' in surface.finish()
    assert surface.finish().endswith(b'data: {"type":"message_stop"}\n\n')


def sse(name: str, data: dict) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, **data}) + b"\n\n"


def test_the_continuing_replicas_events_read_as_one_stream() -> None:
    surface = Messages({"max_tokens": 10, "messages": QUESTION, "stream": True})
    start = sse("message_start", {"message": {"usage": {"input_tokens": 7, "output_tokens": 0}}})

    def delta(token: int) -> bytes:
        text = {"type": "text_delta", "text": "a"}
        return sse("content_block_delta", {"index": 0, "delta": text, "token_ids": [token]})

    assert surface.feed(start) == start
    surface.feed(delta(1))
    surface.feed(delta(2))
    surface.continuation()
    assert surface.feed(start) == b""  # the second replica's preamble is dropped
    assert surface.feed(delta(3)) == delta(3)
    usage = {"input_tokens": 9, "output_tokens": 1}
    rewritten = surface.feed(sse("message_delta", {"delta": {}, "usage": usage}))
    assert b'"output_tokens":3' in rewritten and b'"input_tokens":7' in rewritten
    assert surface.token_ids == [1, 2, 3]


def test_a_stream_without_token_ids_is_not_restarted_elsewhere() -> None:
    """A server that ignores return_token_ids: going on elsewhere would repeat the text."""
    surface = ChatCompletions({"stream": True, "messages": QUESTION})
    assert surface.resumable  # nothing sent yet: another replica may start it
    chunk = {"id": "c1", "choices": [{"index": 0, "delta": {"content": "Hel"}}]}
    surface.feed(b"data: " + orjson.dumps(chunk) + b"\n\n")
    assert not surface.resumable


def test_a_responses_session_keeps_its_replica_by_prompt_cache_key() -> None:
    """Codex sends its session's id as prompt_cache_key: every turn hashes alike, whatever
    its input; without one, the conversation's opening is the key."""
    turn = {"prompt_cache_key": "session-7", "instructions": "Be brief.", "stream": True}
    first = Responses({**turn, "input": "Hi."}).affinity_text()
    assert (
        Responses({**turn, "input": [{"role": "user", "content": "Go on."}]}).affinity_text()
        == first
    )
    assert Responses({**turn, "prompt_cache_key": "session-8"}).affinity_text() != first
    opening = Responses({"instructions": "Be brief.", "input": "Hi."}).affinity_text()
    assert opening == "Be brief.\nHi."


def test_a_responses_stream_resumes_after_the_tokens_the_caller_has() -> None:
    surface = Responses({"stream": True, "input": "Hi.", "max_output_tokens": 8})
    assert surface.resumable and surface.first_body()["return_token_ids"] is True
    created = {"type": "response.created", "sequence_number": 0, "response": {"id": "r1"}}
    surface.feed(b"event: response.created\ndata: " + orjson.dumps(created) + b"\n\n")
    delta = {"type": "response.output_text.delta", "sequence_number": 1, "token_ids": [5, 6]}
    out = surface.feed(b"event: x\ndata: " + orjson.dumps(delta) + b"\n\n")
    assert b"token_ids" not in out, "the caller did not ask for them"
    assert surface.resumable and not surface.done
    body = surface.continuation()
    assert body is not None and body["continue_token_ids"] == [5, 6]
    assert body["max_output_tokens"] == 6
    again = {"type": "response.created", "sequence_number": 0, "response": {"id": "r2"}}
    assert surface.feed(b"event: x\ndata: " + orjson.dumps(again) + b"\n\n") == b""
    done = {"type": "response.completed", "sequence_number": 2, "response": {"id": "r2"}}
    out = surface.feed(b"event: response.completed\ndata: " + orjson.dumps(done) + b"\n\n")
    assert surface.done and b'"id":"r1"' in out and b'"sequence_number":2' in out
