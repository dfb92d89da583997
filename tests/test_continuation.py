"""The server half of mid-stream failover: `return_token_ids` and `continue_token_ids`.

A greedy answer cut after k tokens and continued from those k token ids (as zerohop.client
does on another replica) must go on with exactly the text and tokens of the uninterrupted run.
"""

from __future__ import annotations

import json

import grpc
import httpx
import pytest

from tests.live_server import MODEL_NAME
from zerohop import sse
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2 as pb
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2_grpc as pb_grpc

MAX_TOKENS = 24
CUT = 9


def sse_events(response: httpx.Response) -> list[dict]:
    return [
        json.loads(e.data)
        for e in sse.events(response.iter_bytes())
        if e.data is not None and e.data != b"[DONE]"
    ]


Pieces = list[tuple[list[int], str]]  # each text event's token ids and text


def anthropic_run(url: str, extra: dict) -> tuple[Pieces, dict]:
    body = {
        "model": MODEL_NAME,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "messages": [{"role": "user", "content": "Tell me about the sea and the sky."}],
        "return_token_ids": True,
        **extra,
    }
    with httpx.stream("POST", url + "/v1/messages", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        events = sse_events(response)
    pieces = [
        (e["token_ids"], e["delta"]["text"]) for e in events if e["type"] == "content_block_delta"
    ]
    usage = next(e for e in events if e["type"] == "message_delta")["usage"]
    return pieces, usage


def openai_run(url: str, path: str, extra: dict) -> tuple[Pieces, dict]:
    body = {
        "model": MODEL_NAME,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        **extra,
    }
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "Tell me about the sea and the sky."}]
    else:
        body["prompt"] = "Once upon a time, by the sea,"
    with httpx.stream("POST", url + path, json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        events = sse_events(response)
    choices = [c for e in events for c in e["choices"] if c.get("token_ids")]
    key = "text" if path == "/v1/completions" else "content"
    pieces = [(c["token_ids"], c.get(key) or c.get("delta", {}).get(key) or "") for c in choices]
    return pieces, events[-1]["usage"]


def joined(pieces: Pieces) -> tuple[list[int], str]:
    return [i for ids, _ in pieces for i in ids], "".join(text for _, text in pieces)


@pytest.mark.parametrize(
    "run",
    [
        anthropic_run,
        lambda url, extra: openai_run(url, "/v1/chat/completions", extra),
        lambda url, extra: openai_run(url, "/v1/completions", extra),
    ],
    ids=["anthropic", "chat", "completions"],
)
def test_continuing_from_token_ids_gives_the_uninterrupted_answer(live_server, run) -> None:
    url = live_server.url
    pieces, _ = run(url, {"ignore_eos": True} if run is not anthropic_run else {})
    ids, text = joined(pieces)
    assert len(pieces) >= CUT + 2, "the tiny model ended too early for this test"
    head_ids, head = joined(pieces[:CUT])  # what a caller holds when the replica dies
    extra = {"continue_token_ids": head_ids, "max_tokens": MAX_TOKENS - len(head_ids)}
    if run is not anthropic_run:
        extra["ignore_eos"] = True
    rest, usage = run(url, extra)
    rest_ids, rest_text = joined(rest)
    assert head_ids + rest_ids == ids
    assert head + rest_text == text
    # The continuation's own usage: only its new tokens are output.
    assert usage.get("output_tokens", usage.get("completion_tokens")) == len(rest_ids)


def test_continue_token_ids_outside_the_vocabulary_is_a_400(live_server) -> None:
    body = {
        "model": MODEL_NAME,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
        "continue_token_ids": [10**9],
    }
    response = httpx.post(live_server.url + "/v1/messages", json=body, timeout=30)
    assert response.status_code == 400
    assert "continue_token_ids" in response.json()["error"]["message"]


def test_grpc_generate_continues_from_token_ids(live_server) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{live_server.grpc_port}") as channel:
        stub = pb_grpc.ZerohopStub(channel)

        def generate(**fields) -> Pieces:
            request = pb.GenerateRequest(
                model=MODEL_NAME, prompt="The sea", temperature=0, ignore_eos=True, **fields
            )
            return [(list(r.token_ids), r.text) for r in stub.Generate(request, timeout=60)]

        pieces = generate(max_tokens=MAX_TOKENS)
        ids, text = joined(pieces)
        head_ids, head = joined(pieces[:CUT])
        rest_ids, rest = joined(
            generate(max_tokens=MAX_TOKENS - len(head_ids), continue_token_ids=head_ids)
        )
    assert head_ids + rest_ids == ids
    assert head + rest == text
