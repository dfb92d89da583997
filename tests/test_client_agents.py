"""zerohop.client carries agent traffic: the official SDKs' tool calls, streamed through
`http_client`, with the answering replica SIGKILLed mid-call. The
continuing replica reads the continued tokens through the same call reader and grammar, so the
SDK assembles one call at the block index (the tool_calls index) it began at, equal to an
uninterrupted greedy run's. A streamed request that thinks is served through the client.

Two replicas of the tiny llama with Qwen3's template; the engines sleep a little after each
step, so a stream is still being decoded when its replica dies. A replica killed by one test
is restarted for the next.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from tests.fixtures.qwen3_template import QWEN3_THINKING_TEMPLATE
from tests.live_server import (
    MODEL_NAME,
    LiveServer,
    kill_busy,
    started_together,
    with_chat_template,
)
from zerohop.client import ReplicaPool, http_client

STEP_DELAY = "0.01"  # seconds each engine sleeps after a step
MAX_TOKENS = 192  # the random model writes a call in about 130
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "note": {"type": "string", "maxLength": 24},
    },
    "required": ["city", "unit", "days", "note"],
    "additionalProperties": False,
}
GREEDY = {"temperature": 0}
USER = [{"role": "user", "content": "What will the weather be in Paris this week?"}]
TOOL = {"name": "get_weather", "description": "The weather forecast.", "input_schema": SCHEMA}
MESSAGES: dict[str, Any] = {
    "model": MODEL_NAME,
    "max_tokens": MAX_TOKENS,
    "extra_body": GREEDY,
    "messages": USER,
    "tools": [TOOL],
    "tool_choice": {"type": "tool", "name": "get_weather"},
}
CHAT: dict[str, Any] = {
    "model": MODEL_NAME,
    "max_tokens": MAX_TOKENS,
    "temperature": 0,
    "messages": USER,
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}],
    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
}


@pytest.fixture(scope="module")
def fleet(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LiveServer]]:
    folder = tmp_path_factory.mktemp("agents-model") / "qwen3"
    model_dir = with_chat_template(tiny_model("qwen3"), folder, QWEN3_THINKING_TEMPLATE)
    specs = {f"agents{i}": ["--debug-step-delay", STEP_DELAY] for i in range(2)}
    with started_together(model_dir, specs, tmp_path_factory) as servers:
        yield list(servers.values())


@pytest.fixture
def pool(fleet: list[LiveServer], tmp_path: Path) -> Iterator[ReplicaPool]:
    """Both replicas alive (one a test killed is started again), in a pool of their own."""
    for i, server in enumerate(fleet):
        if server.process is None or server.process.poll() is not None:
            server.start(tmp_path / f"restarted{i}.log")
    with ReplicaPool([s.url for s in fleet], health_interval=0.5) as replicas:
        yield replicas


def claude(pool: ReplicaPool) -> anthropic.Anthropic:
    # max_retries=0: an error the transport let through reaches the test.
    return anthropic.Anthropic(
        base_url="http://zerohop",
        api_key="unused",
        max_retries=0,
        http_client=http_client(pool=pool),
    )


def test_messages_tool_call_cut_by_sigkill_is_one_call(
    fleet: list[LiveServer], pool: ReplicaPool
) -> None:
    client = claude(pool)
    # Claude Code's shape, thinking on and streamed (the client asks for token ids): served.
    thinking = {"type": "enabled", "budget_tokens": 1024}
    plain = {"model": MODEL_NAME, "max_tokens": 1100, "messages": USER, "thinking": thinking}
    with client.messages.stream(**plain) as stream:
        assert next(iter(stream)).type == "message_start"
    whole = client.messages.create(**MESSAGES)  # not streamed: passes through as it is
    victim, after = "", 0
    with client.messages.stream(**MESSAGES) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                after += bool(victim)
                if not victim:
                    victim = kill_busy(pool, fleet)
        final = stream.get_final_message()
    assert pool.stats()[victim]["resumes"] == 1
    assert after > 0, "the continuation wrote part of the call"
    assert [b.type for b in final.content] == ["tool_use"] == [b.type for b in whole.content]
    call = final.content[0]
    assert call.type == "tool_use" and call.name == "get_weather"
    jsonschema.validate(call.input, SCHEMA)
    assert call.input == whole.content[0].input  # type: ignore[union-attr]
    assert final.stop_reason == "tool_use"
    assert final.usage.output_tokens == whole.usage.output_tokens, "each token counted once"


def test_chat_tool_call_cut_by_sigkill_continues_at_its_index(
    fleet: list[LiveServer], pool: ReplicaPool
) -> None:
    client = openai.OpenAI(
        base_url="http://zerohop/v1", api_key="unused", max_retries=0,
        http_client=http_client(pool=pool),
    )  # fmt: skip
    whole = client.chat.completions.create(**CHAT).choices[0].message.tool_calls
    assert whole is not None and len(whole) == 1
    victim, after = "", 0
    with client.chat.completions.stream(**CHAT) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                after += bool(victim)
                if not victim:
                    victim = kill_busy(pool, fleet)
        final = stream.get_final_completion().choices[0]
    assert pool.stats()[victim]["resumes"] == 1
    assert after > 0, "the continuation wrote part of the call"
    calls = final.message.tool_calls
    assert calls is not None and len(calls) == 1 and final.finish_reason == "tool_calls"
    arguments = json.loads(calls[0].function.arguments)
    jsonschema.validate(arguments, SCHEMA)
    assert arguments == json.loads(whole[0].function.arguments)
    assert calls[0].function.name == "get_weather"
