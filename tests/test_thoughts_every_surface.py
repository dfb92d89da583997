"""One conversation, with a thought in an earlier exchange and one in the current tool loop,
through Messages, Chat, Responses and gRPC: the chat template receives the same messages
from each, the current loop's thought as `reasoning_content` and the earlier
one left out, and Qwen3's template renders the same prompt. Messages' thoughts are signed
(serving/thought_signatures.py); the others have no signatures and take them as sent,
as vLLM does."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.fixtures.qwen3_template import QWEN3_THINKING_TEMPLATE
from tests.live_server import with_chat_template
from tests.test_thought_signatures import sign, signer
from zerohop.api.anthropic.schema import decode_messages
from zerohop.api.anthropic.turns import conversation as messages_conversation
from zerohop.api.conversation.planner import prompt_ids, template_turns
from zerohop.api.conversation.request import Conversation
from zerohop.api.grpc.tools import conversation as grpc_conversation
from zerohop.api.openai.schema import ChatRequest, decode
from zerohop.api.openai.turns import conversation as chat_conversation
from zerohop.api.responses.schema import decode_request
from zerohop.api.responses.surface import ResponsesSurface
from zerohop.api.serving.service import ServingContext
from zerohop.api.serving.thought_signatures import PURPOSE
from zerohop.engine.text.tokenizer import Tokenizer
from zerohop.gateway.gateway import Call
from zerohop.gateway.server_keys import ServerKeys
from zerohop.gateway.store.spec import StoreSpec
from zerohop.gateway.store.store import Store
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2 as pb

MODEL = "tiny-qwen3"
EARLIER = "the user greets me: greet back"
THOUGHT = "the user wants the weather: call the tool"
QUESTION = "What is the weather?"
SCHEMA = {"type": "object", "properties": {}}


@pytest.fixture(scope="module")
def ctx(tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp("qwen3-template") / "qwen3"
    model_dir = with_chat_template(tiny_model("qwen3"), folder, QWEN3_THINKING_TEMPLATE)
    return ServingContext(None, Tokenizer.from_dir(model_dir), MODEL, 4096)  # type: ignore[arg-type]


def through_messages(ctx: ServingContext, keys: ServerKeys) -> Conversation:
    signatures = {
        thought: sign(keys, thought=thought, model=MODEL) for thought in (EARLIER, THOUGHT)
    }

    def thinking(thought: str) -> dict[str, str]:
        return {"type": "thinking", "thinking": thought, "signature": signatures[thought]}

    messages = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": [thinking(EARLIER), {"type": "text", "text": "Hi!"}]},
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": [
                thinking(THOUGHT),
                {"type": "tool_use", "id": "toolu_01", "name": "weather", "input": {}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "sunny"}],
        },
    ]
    tool = {"name": "weather", "description": "The weather now", "input_schema": SCHEMA}
    body = {"model": MODEL, "max_tokens": 64, "messages": messages, "tools": [tool]}
    request = decode_messages(msgspec.json.encode(body))
    template = ctx.tokenizer.chat_template
    verifier = signer(keys, model=MODEL, signatures=tuple(signatures.values()))
    return messages_conversation(request, template, signer=verifier)


def through_chat(ctx: ServingContext) -> Conversation:
    call = {"id": "call_01", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi!", "reasoning_content": EARLIER},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning": THOUGHT},
        {"role": "tool", "tool_call_id": "call_01", "content": "sunny"},
    ]
    function = {"name": "weather", "description": "The weather now", "parameters": SCHEMA}
    body = {
        "model": MODEL,
        "messages": messages,
        "tools": [{"type": "function", "function": function}],
    }
    return chat_conversation(decode(json.dumps(body).encode(), ChatRequest), {})


def through_grpc() -> Conversation:
    call = pb.ToolCall(id="call_01", name="weather", arguments_json="{}")
    messages = [
        pb.ChatMessage(role="user", content="Hello"),
        pb.ChatMessage(role="assistant", content="Hi!", thought=EARLIER),
        pb.ChatMessage(role="user", content=QUESTION),
        pb.ChatMessage(role="assistant", tool_calls=[call], thought=THOUGHT),
        pb.ChatMessage(role="tool", tool_call_id="call_01", content="sunny"),
    ]
    tool = pb.Tool(
        name="weather", description="The weather now", parameters_json=json.dumps(SCHEMA)
    )
    request = pb.GenerateRequest(
        model=MODEL, messages=pb.ChatMessages(messages=messages), tools=[tool]
    )
    return grpc_conversation(request)


def responses_prompt(ctx: ServingContext) -> list[int]:
    def reasoning(thought: str) -> dict[str, Any]:
        text = [{"type": "reasoning_text", "text": thought}]
        return {"type": "reasoning", "id": "rs_1", "summary": [], "content": text}

    items = [
        {"role": "user", "content": "Hello"},
        reasoning(EARLIER),
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hi!"}]},
        {"role": "user", "content": QUESTION},
        reasoning(THOUGHT),
        {"type": "function_call", "call_id": "call_01", "name": "weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_01", "output": "sunny"},
    ]
    tool = {"type": "function", "name": "weather", "description": "The weather now"}
    body = {"model": MODEL, "input": items, "tools": [{**tool, "parameters": SCHEMA}]}
    request = decode_request(json.dumps(body).encode())
    surface = ResponsesSurface(ctx)
    prepared = asyncio.run(surface._prepare(request, Call("req_1", "openai")))
    return prepared.planned.prompt


def test_the_template_receives_the_same_thoughts_from_every_surface(
    ctx: ServingContext, tmp_path: Path
) -> None:
    store = Store.of(StoreSpec.sqlite(tmp_path / "keys.db"))
    keys = ServerKeys(store.signing_keys, PURPOSE)
    by_messages, by_chat, by_grpc = through_messages(ctx, keys), through_chat(ctx), through_grpc()
    turns = template_turns(by_messages)
    assert template_turns(by_chat) == turns
    assert template_turns(by_grpc) == turns
    thoughts = [t.get("reasoning_content") for t in turns if t["role"] == "assistant"]
    assert thoughts == [None, THOUGHT]  # the earlier exchange's is left out, as Qwen3 does

    prompt = prompt_ids(by_messages, ctx)
    assert prompt_ids(by_chat, ctx) == prompt
    assert prompt_ids(by_grpc, ctx) == prompt
    assert responses_prompt(ctx) == prompt
    text = ctx.tokenizer.decode(prompt, skip_special_tokens=False)
    assert f"<|im_start|>assistant\n<think>\n{THOUGHT}\n</think>\n\n<tool_call>" in text
    assert EARLIER not in text
    store.close()
