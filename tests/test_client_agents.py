"""zerohop.client carries agent traffic: the official SDKs' tool calls, thoughts and
structured answers, streamed through `http_client`, with the answering replica SIGKILLed
mid-way. The continuing replica reads the continued tokens through the same thought / call
reader and grammar, so the SDK assembles one call at the block index (the tool_calls index,
the Responses item) it began at, one thinking block goes on at index 0 with its signature,
and an answer in a JSON schema stays in it, each equal to an uninterrupted greedy run's.
The thought is adaptive (it runs to max_tokens): a `budget_tokens` is at least 1024, over a
thousand steps of these slowed engines.

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

from tests.cutting_proxy import cutting_proxy
from tests.fixtures.qwen3_template import QWEN3_THINKING_TEMPLATE
from tests.live_server import (
    MODEL_NAME,
    LiveServer,
    kill_busy,
    started_together,
    with_chat_template,
)
from tests.test_client_pinning import question_for
from zerohop.api.conversation.events import OutputReader
from zerohop.api.conversation.reasoning import ReasoningParser
from zerohop.api.generation.continued import thought_tokens
from zerohop.client import ReplicaPool, http_client
from zerohop.engine.text.tokenizer import Tokenizer

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


THINKING: dict[str, Any] = {
    "model": MODEL_NAME,
    "max_tokens": 48,
    "extra_body": GREEDY,
    "messages": USER,
    "thinking": {"type": "adaptive"},
}
RAW = {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"}


def test_thought_cut_by_sigkill_goes_on_in_its_block(
    fleet: list[LiveServer], pool: ReplicaPool
) -> None:
    client = claude(pool)
    whole = client.messages.create(**THINKING)
    victim, after, events = "", 0, []
    with client.messages.stream(**THINKING) as stream:
        for event in stream:
            events += [event] if event.type in RAW else []
            if event.type == "content_block_delta" and event.delta.type == "thinking_delta":
                after += bool(victim)
                if not victim and len(events) > 3:
                    victim = kill_busy(pool, fleet)
        final = stream.get_final_message()
    assert pool.stats()[victim]["resumes"] == 1
    assert after > 0, "the continuation wrote part of the thought"
    starts = [(e.index, e.content_block.type) for e in events if e.type == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text")], "one thought, then the text"
    assert [e.index for e in events if e.type == "content_block_stop"] == [0, 1]
    deltas = [(e.index, e.delta) for e in events if e.type == "content_block_delta"]
    kinds = [(i, d.type) for i, d in deltas if d.type != "thinking_delta"]
    assert kinds[0] == (0, "signature_delta") and all(i == 1 for i, _ in kinds[1:])
    assert all(i == 0 for i, d in deltas if d.type == "thinking_delta")
    thought = "".join(d.thinking for _, d in deltas if d.type == "thinking_delta")
    text = "".join(d.text for _, d in deltas if d.type == "text_delta")
    first, answer = final.content
    assert first.type == "thinking" and answer.type == "text"
    assert first.thinking == thought == whole.content[0].thinking != ""  # type: ignore[union-attr]
    assert first.signature == deltas[len(deltas) - len(kinds)][1].signature != ""  # type: ignore[union-attr]
    assert answer.text == text == whole.content[1].text  # type: ignore[union-attr]
    assert final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.output_tokens == whole.usage.output_tokens, "each token counted once"


def test_structured_answer_cut_by_sigkill_keeps_its_schema(
    fleet: list[LiveServer], pool: ReplicaPool
) -> None:
    client = openai.OpenAI(
        base_url="http://zerohop/v1", api_key="unused", max_retries=0,
        http_client=http_client(pool=pool),
    )  # fmt: skip
    schema = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    asked = {**CHAT, "response_format": schema, "tools": openai.omit, "tool_choice": openai.omit}
    whole = client.chat.completions.create(**asked).choices[0].message.content
    victim, pieces = "", []
    with client.chat.completions.stream(**asked) as stream:
        for event in stream:
            if event.type == "content.delta":
                pieces.append(event.delta)
                if len(pieces) == 5:
                    victim = kill_busy(pool, fleet)
        final = stream.get_final_completion()
    assert pool.stats()[victim]["resumes"] == 1
    assert len(pieces) > 5, "the continuation wrote part of the answer"
    answer = final.choices[0].message.content
    assert answer == "".join(pieces) == whole
    jsonschema.validate(json.loads(answer), SCHEMA)
    assert final.choices[0].finish_reason == "stop"


def test_responses_function_call_cut_by_sigkill_is_one_item(
    fleet: list[LiveServer], pool: ReplicaPool
) -> None:
    client = openai.OpenAI(
        base_url="http://zerohop/v1", api_key="unused", max_retries=0,
        http_client=http_client(pool=pool),
    )  # fmt: skip
    asked: dict[str, Any] = {
        "model": MODEL_NAME,
        "input": USER,
        "max_output_tokens": MAX_TOKENS,
        "temperature": 0,
        "tools": [{"type": "function", "name": "get_weather", "parameters": SCHEMA}],
        "tool_choice": {"type": "function", "name": "get_weather"},
    }
    whole = client.responses.create(**asked)
    victim, after, events = "", 0, []
    for event in client.responses.create(**asked, stream=True):
        events.append(event)
        if event.type == "response.function_call_arguments.delta":
            after += bool(victim)
            if not victim:
                victim = kill_busy(pool, fleet)
    assert pool.stats()[victim]["resumes"] == 1
    assert after > 0, "the continuation wrote part of the call"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e.item for e in events if e.type == "response.output_item.added"]  # type: ignore[union-attr]
    done = [e.item for e in events if e.type == "response.output_item.done"]  # type: ignore[union-attr]
    assert len(added) == len(done) == 1 and added[0].type == done[0].type == "function_call"
    item, call = done[0], added[0]
    assert (item.id, item.call_id) == (call.id, call.call_id)  # type: ignore[union-attr]
    pieces = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert {(e.item_id, e.output_index) for e in pieces} == {(call.id, 0)}  # type: ignore[union-attr]
    arguments = "".join(e.delta for e in pieces)  # type: ignore[union-attr]
    assert item.arguments == arguments  # type: ignore[union-attr]
    final = events[-1]
    assert final.type == "response.completed" and final.response.output == [item]
    assert json.loads(arguments) == json.loads(whole.output[0].arguments)  # type: ignore[union-attr]
    assert final.response.usage.output_tokens == whole.usage.output_tokens  # type: ignore[union-attr]
    jsonschema.validate(json.loads(arguments), SCHEMA)


def alive(fleet: list[LiveServer]) -> LiveServer:
    """A replica the tests before left running (each kills one, the next restarts it)."""
    return next(s for s in fleet if s.process is not None and s.process.poll() is None)


def test_a_thought_cut_with_no_tokens_left_ends_as_the_replica_would(
    fleet: list[LiveServer],
) -> None:
    server, asked = alive(fleet), {**THINKING, "max_tokens": 12}
    # The thought ran to max_tokens and was signed: cut before the empty text block.
    marker = b'event: content_block_start\ndata: {"type":"content_block_start","index":1'
    with (
        cutting_proxy(server.port, marker) as url,
        ReplicaPool([url], health_interval=0.5) as pool,
    ):
        with claude(pool).messages.stream(**asked) as stream:
            events = [e for e in stream if e.type in RAW]
            final = stream.get_final_message()
        assert pool.stats()[url]["resumes"] == 1
    direct = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    with direct.messages.stream(**asked) as stream:
        expected = [e for e in stream if e.type in RAW]
        whole = stream.get_final_message()

    def shape(events: list[Any]) -> list[tuple[str, Any]]:
        return [(e.type, getattr(e, "index", None)) for e in events]

    assert shape(events) == shape(expected)
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content == whole.content and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == whole.usage.output_tokens == 12


def test_reasoning_tokens_after_a_failover_count_the_first_replicas_thought(
    fleet: list[LiveServer],
) -> None:
    server = alive(fleet)
    # Cut mid-thought, after the caller has its first events (each with a sequence number).
    with (
        cutting_proxy(server.port, b'"sequence_number":12') as url,
        ReplicaPool([url, server.url], health_interval=0.5) as pool,
    ):
        client = openai.OpenAI(
            base_url="http://zerohop/v1", api_key="unused", max_retries=0,
            http_client=http_client(pool=pool),
        )  # fmt: skip
        asked = {"model": MODEL_NAME, "input": question_for(pool, url), **GREEDY}
        events = list(client.responses.create(**asked, max_output_tokens=48, stream=True))
        assert pool.stats()[url]["resumes"] == 1
    whole = openai.OpenAI(base_url=server.url + "/v1", api_key="unused").responses.create(
        **asked, max_output_tokens=48
    )
    kinds = [e.type for e in events]
    assert kinds.count("response.created") == 1 and kinds[-1] == "response." + whole.status
    reasoning = [e for e in events if e.type == "response.reasoning_text.delta"]
    assert len(reasoning) > 12, "the continuation went on with the thought"
    usage, expected = events[-1].response.usage, whole.usage  # type: ignore[union-attr]
    assert usage is not None and expected is not None
    assert (usage.input_tokens, usage.output_tokens) == (
        expected.input_tokens,
        expected.output_tokens,
    )
    assert usage.input_tokens_details.cached_tokens <= usage.input_tokens
    thought = expected.output_tokens_details.reasoning_tokens
    assert usage.output_tokens_details.reasoning_tokens == thought > 0


def uninterrupted_thought_tokens(tokenizer: Tokenizer, tokens: list[int]) -> int:
    """The driver's count, one token a step: a token read while the thought is open."""
    reader, text, counted = OutputReader(ReasoningParser(in_thought=True)), "", 0
    for i in range(1, len(tokens) + 1):
        counted += not reader.thought_ended
        now = tokenizer.decode(tokens[:i]).rstrip("\ufffd")
        reader.feed(now[len(text) :])
        text = now
    return counted


@pytest.mark.parametrize(
    "answer",
    ["plan the trip</think>\n\nParis is nice.", "a</think>b", "still thinking </thi", "x" * 9],
)
def test_a_continued_thought_counts_as_an_uninterrupted_runs(tiny_model: Any, answer: str) -> None:
    tokenizer = Tokenizer.from_dir(tiny_model("qwen3"))  # the fleet's model: built already
    tokens = tokenizer.encode(answer, add_special_tokens=False)
    counted = thought_tokens(
        tokenizer.decode, tokens, lambda: OutputReader(ReasoningParser(in_thought=True))
    )
    assert counted == uninterrupted_thought_tokens(tokenizer, tokens)
    assert (counted < len(tokens)) == ("</think>" in answer)
