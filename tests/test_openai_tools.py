"""Tool calls on the OpenAI Chat Completions surface, with the official SDK against a live
server on the tiny random model: forced calls (required, named) validate against the tool's
schema, whole and streamed (the SDK's accumulator rebuilds them), a second turn with the
calls and their results is accepted, "none" gives no calls, bad definitions are 400s."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import msgspec
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from tests.fixtures.tool_schemas import ADD, WEATHER
from tests.grammar_check import decodes
from tests.live_server import MODEL_NAME, LiveServer
from tests.scripted_engine import scripted_generation
from zerohop.api.conversation.events import OutputReader
from zerohop.api.conversation.planner import grammar as planned_grammar
from zerohop.api.conversation.reasoning import ReasoningParser
from zerohop.api.openai.choices import ChatAnswer
from zerohop.api.openai.events_stream import EventChatStream
from zerohop.api.openai.output import LogprobFormatter
from zerohop.api.openai.schema import ChatRequest
from zerohop.api.openai.turns import conversation
from zerohop.api.tools.forced_stream import ForcedCallParser
from zerohop.api.tools.hermes import HermesParser
from zerohop.api.tools.mistral import MistralParser
from zerohop.api.tools.spec import Tool, ToolSet
from zerohop.engine.base.outputs import RequestDelta
from zerohop.engine.structured import grammar as g

TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather.", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]
MAX = 200  # random whitespace between JSON tokens takes room


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="any", max_retries=0)


def create(server: LiveServer, **body: Any) -> Any:
    body = {"model": MODEL_NAME, "messages": MESSAGES, "tools": TOOLS, "max_tokens": MAX, **body}
    body.setdefault("seed", 1)
    return client(server).chat.completions.create(**body)


def check_call(call: Any, name: str | None = None) -> None:
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29
    assert name is None or call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize(
    ("choice", "name"),
    [("required", None), ({"type": "function", "function": {"name": "add"}}, "add")],
)
def test_forced_call(live_server: LiveServer, choice: Any, name: str | None) -> None:
    got = create(live_server, tool_choice=choice, n=2, seed=1)
    for c in got.choices:
        assert c.finish_reason == "tool_calls", c
        assert c.message.content is None and len(c.message.tool_calls) == 1
        check_call(c.message.tool_calls[0], name)


def test_forced_call_streamed(live_server: LiveServer) -> None:
    body = {"model": MODEL_NAME, "messages": MESSAGES, "tools": TOOLS, "max_tokens": MAX, "seed": 2}
    with client(live_server).chat.completions.stream(**body, tool_choice="required") as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0])


BOOK = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Oslo", "Rome"]},
        "note": {"type": "string", "maxLength": 24},
        "nights": {"type": "integer", "minimum": 1, "maximum": 9},
        "breakfast": {"type": "boolean"},
    },
    "required": ["city", "note", "nights", "breakfast"],
    "additionalProperties": False,
}


def test_forced_call_streams_its_arguments_as_decoded(live_server: LiveServer) -> None:
    """The name first (with id, type and arguments ""), then the arguments' text in pieces;
    the SDK's accumulated completion holds the call the whole response holds."""
    book = {"type": "function", "function": {"name": "book", "parameters": BOOK}}
    choice = {"type": "function", "function": {"name": "book"}}
    body = {"model": MODEL_NAME, "messages": MESSAGES, "tools": [book], "tool_choice": choice}
    body |= {"max_tokens": 300, "seed": 3}
    whole = client(live_server).chat.completions.create(**body).choices[0].message.tool_calls[0]
    deltas = []
    with client(live_server).chat.completions.stream(**body) as stream:
        for event in stream:
            if event.type == "chunk":
                deltas += [d for c in event.chunk.choices for d in c.delta.tool_calls or []]
        final = stream.get_final_completion()
    first, rest = deltas[0], deltas[1:]
    assert (first.index, first.type, first.function.name, first.function.arguments) == (
        0, "function", "book", "")  # fmt: skip
    assert first.id.startswith("call_") and len(rest) > 1
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    (call,) = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls" and call.id == first.id
    assert call.function.arguments == "".join(d.function.arguments for d in rest)
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, BOOK)
    assert (call.function.name, arguments) == ("book", json.loads(whole.function.arguments))


STRICT = [{"type": "function", "function": {"name": "book", "parameters": BOOK, "strict": True}}]
STRICT_CALL = (
    '<tool_call>\n{"name": "book", "arguments": {"city": "Rome", "note": "", "nights": 2,'
    ' "breakfast": true}}\n</tool_call>'
)


def test_strict_tools_in_auto_mode_allow_text_and_only_valid_calls(llama_dir: Path) -> None:
    conv = conversation(chat_request(MESSAGES, tools=STRICT), {})
    grammar = planned_grammar(conv, HermesParser)
    assert grammar is not None
    for text in ["", "Plain text, even <tool_cal> or </tool_call>.", STRICT_CALL,
                 f"Booking.\n{STRICT_CALL}\nand {STRICT_CALL} done"]:  # fmt: skip
        assert decodes(llama_dir, grammar, text), text
    refused = [STRICT_CALL.replace("2", '"2"'), STRICT_CALL.replace("book", "cook"),
               STRICT_CALL.replace(', "breakfast": true', ""), "a <tool_call>{}"]  # fmt: skip
    for text in refused:
        assert not decodes(llama_dir, grammar, text), text
    conv.output_grammar = g.json_schema_grammar({"enum": [1]})
    union = planned_grammar(conv, HermesParser)  # a call, or else the answer in the format
    assert decodes(llama_dir, union, "1") and decodes(llama_dir, union, STRICT_CALL)
    assert not decodes(llama_dir, union, "Booking.")
    loose = chat_request(MESSAGES, tools=[*STRICT, TOOLS[1]])
    assert planned_grammar(conversation(loose, {}), HermesParser) is None
    strict = conversation(chat_request(MESSAGES, tools=STRICT), {})
    assert planned_grammar(strict, MistralParser) is None


def test_strict_tools_in_auto_mode_decode(live_server: LiveServer) -> None:
    got = create(live_server, tools=STRICT, n=2, max_tokens=24)
    for choice in got.choices:
        assert choice.finish_reason in ("stop", "length", "tool_calls"), choice
        for call in choice.message.tool_calls or []:
            jsonschema.validate(json.loads(call.function.arguments), BOOK)


def test_second_turn(live_server: LiveServer) -> None:
    first = create(
        live_server, tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    message = first.choices[0].message
    assert message.tool_calls, first.model_dump()
    call = message.tool_calls[0]
    messages = [
        *MESSAGES,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": [{"type": "text", "text": "Sunny"}]},
    ]
    got = create(live_server, messages=messages, max_tokens=4)
    assert got.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_cut_off_calls_arguments_are_taken_back_as_text(live_server: LiveServer) -> None:
    # finish_reason "length" mid-call leaves arguments that are no JSON object: sent back as
    # they came, they are the model's own text, not a 400.
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Osl'}}  # fmt: skip
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
    ]
    got = create(live_server, messages=messages, max_tokens=2)
    assert got.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_none_gives_no_calls(live_server: LiveServer) -> None:
    got = create(live_server, tool_choice="none", max_tokens=8)
    assert got.choices[0].message.tool_calls is None
    assert got.choices[0].finish_reason in ("stop", "length")


def chat_request(messages: list, **fields: Any) -> ChatRequest:
    """A chat request as the surface decodes it (its messages Structs, not dicts)."""
    body = {"model": "m", "messages": messages, **fields}
    return msgspec.json.decode(msgspec.json.encode(body), type=ChatRequest)


def message_fields(text: str, names: Any, finish_reason: str) -> tuple[dict[str, Any], str]:
    """A whole answer's message read as the surface reads it, calls in Hermes."""
    script = [RequestDelta("r", [1], text, finished=True, finish_reason=finish_reason)]

    def reader() -> OutputReader:
        return OutputReader(None, HermesParser(names))

    generation = scripted_generation(None, script, readers=reader, stream=False)
    answer = ChatAnswer(1, None, LogprobFormatter.__new__(LogprobFormatter))

    async def read() -> None:
        async for step in generation.steps():
            answer.add(step)

    asyncio.run(read())
    (choice,) = answer.body()
    return choice["message"], choice["finish_reason"]


def test_auto_parses_a_call() -> None:
    text = 'Hm <tool_call>{"name": "add", "arguments": {"a": 3}}</tool_call>'
    message, reason = message_fields(text, {"add"}, "stop")
    assert reason == "tool_calls" and message["content"] == "Hm "
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"a": 3}
    assert message_fields("<tool_call>x</tool_call>", {"add"}, "stop")[1] == "stop"


def test_auto_returns_a_call_its_schema_refuses_as_text() -> None:
    tools = ToolSet([Tool("add", parameters=ADD)])
    text = 'Hm <tool_call>{"name": "add", "arguments": {"a": 12}}</tool_call>'
    assert message_fields(text, tools, "stop") == ({"role": "assistant", "content": text}, "stop")
    good = text.replace("12", "3")
    assert message_fields(good, tools, "stop")[1] == "tool_calls"


def test_a_tool_schema_that_is_not_a_json_schema_is_a_400(live_server: LiveServer) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "int"}}}
    bad = [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": schema}}]
    with pytest.raises(openai.BadRequestError) as info:
        create(live_server, tools=bad, max_tokens=2)
    assert info.value.param == "tools" and info.value.type == "invalid_request_error"
    assert "tools[1].function.parameters: not a valid JSON schema: " in info.value.message


BAD_NAME = [{"type": "function", "function": {"name": "no spaces"}}]
ARRAY = [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]
ORPHAN = [*MESSAGES, {"role": "tool", "tool_call_id": "call_nope", "content": "x"}]
UNIQUE = {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}
UNCOMPILABLE = [{"type": "function", "function": {"name": "f", "parameters": UNIQUE}}]
STRICT_UNCOMPILABLE = [{"type": "function", "function": {
    "name": "f", "parameters": UNIQUE, "strict": True}}]  # fmt: skip
BAD = {
    "bad-name": ({"tools": BAD_NAME}, "tools", "must be 1 to 64"),
    "not-object": ({"tools": ARRAY}, "tools", "type must be 'object'"),
    "duplicate": ({"tools": [TOOLS[1], TOOLS[1]]}, "tools", "used twice"),
    "not-function": ({"tools": [{"type": "web"}]}, "tools", "only 'function'"),
    "unknown-named": (
        {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "no tool named",
    ),
    "bad-choice": ({"tool_choice": "sometimes"}, "tool_choice", "must be"),
    "forced-no-tools": ({"tools": None, "tool_choice": "required"}, "tool_choice", "requires"),
    "orphan": ({"messages": ORPHAN}, "messages[1].tool_call_id", "answers no earlier"),
    "forced-uncompilable": (
        {"tools": UNCOMPILABLE, "tool_choice": "required"},
        "tools",
        'failed to compile JSON schema: Unimplemented keys: ["uniqueItems"]',
    ),
    "strict-uncompilable": ({"tools": STRICT_UNCOMPILABLE}, "tools", "uniqueItems"),
    "forced-and-raw-constraint": (
        {"tool_choice": "required", "structured_outputs": {"regex": "a+"}},
        "tool_choice",
        "cannot be combined with response_format or structured_outputs",
    ),
}


@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
def test_refused(live_server: LiveServer, case: tuple[dict, str, str]) -> None:
    fields, param, words = case
    body = {"model": MODEL_NAME, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 2, **fields}
    response = httpx.post(live_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param and words in error["message"], error


def stream_chunks(
    pieces: list[str], n: int = 1, parser: Any = HermesParser, in_thought: bool | None = None
) -> list[dict]:
    def reader() -> OutputReader:
        thoughts = None if in_thought is None else ReasoningParser(in_thought)
        return OutputReader(thoughts, parser({"add"}))

    script = [
        RequestDelta("r", [1], piece, finished=j == len(pieces) - 1, finish_reason="stop", index=i)
        for i in range(n)
        for j, piece in enumerate(pieces)
    ]
    generation = scripted_generation(None, script, n=n, readers=reader, stream=False)
    formatter = LogprobFormatter.__new__(LogprobFormatter)
    stream = EventChatStream("req_x", "chatcmpl-x", MODEL_NAME, False, formatter, n, top=None)

    async def encode() -> bytes:
        data = b""
        async for step in generation.steps():
            data += stream.step(step)
        return data

    data = stream.opening(None) + asyncio.run(encode())  # type: ignore[arg-type]
    events = [e.removeprefix(b"data: ") for e in data.split(b"\n\n") if e]
    return [json.loads(e) for e in events]


@pytest.mark.parametrize("in_thought", [False, True])
def test_a_reasoning_stream_splits_the_thought_then_reads_calls(in_thought: bool) -> None:
    # A reasoning model with tools: the thought streams as reasoning_content, the call
    # after it as tool_calls, and the SDK's accumulator rebuilds both.
    text = ("" if in_thought else "<think>") + "weigh it </thi</think>\n\n"
    text += '<tool_call>{"name": "add", "arguments": {"a": 3}}</tool_call>'
    pieces = [text[i : i + 4] for i in range(0, len(text), 4)]
    chunks = stream_chunks(pieces, in_thought=in_thought)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    thought = "".join(d.get("reasoning_content") or "" for d in deltas)
    assert thought == "weigh it </thi" and all(d.get("reasoning") == d.get("reasoning_content")
                                              for d in deltas)  # fmt: skip
    assert not "".join(d.get("content") or "" for d in deltas)
    first_call = next(i for i, d in enumerate(deltas) if d.get("tool_calls"))
    assert all(not d.get("reasoning_content") for d in deltas[first_call:])
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    (choice,) = state.get_final_completion().choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert json.loads(call.function.arguments) == {"a": 3}


def test_auto_stream_rebuilds_text_and_calls() -> None:
    text = 'Hm <tool_call>{"name": "add", "arguments": {"a": 3}}</tool_call> ok'
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    chunks = stream_chunks(pieces, n=2)
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    final = state.get_final_completion()
    for choice in final.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Hm  ok"
        (call,) = choice.message.tool_calls
        assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 3}
    whole, _ = message_fields(text, {"add"}, "stop")
    assert whole["content"] == "Hm  ok"


def test_a_forced_stream_sends_one_chunk_per_token_once_the_call_is_named() -> None:
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
    pieces = [text[i : i + 2] for i in range(0, len(text), 2)]
    chunks = stream_chunks(pieces, parser=ForcedCallParser)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    named = next(i for i, d in enumerate(deltas) if "tool_calls" in d)
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert all(d == {"content": ""} for d in deltas[1:named])  # one per token until then
    assert deltas[named]["tool_calls"][0]["function"] == {"name": "add", "arguments": ""}
    after = deltas[named + 1 : -1]
    fragments = [d["tool_calls"][0]["function"]["arguments"] for d in after if "tool_calls" in d]
    assert "".join(fragments) == '{"a": 3, "b": 4}' and all(fragments)
    assert all(d == {"content": ""} for d in after if "tool_calls" not in d)  # the closing
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def written(text: str) -> str:
    """A regex under which the model writes exactly `text`."""
    return "".join("\\" + c if c in r"\.^$*+?()[]{}|/" else c for c in text)


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_keeps_the_first_call(
    live_server: LiveServer, stream: bool
) -> None:
    """Two calls written; `parallel_tool_calls: false` gives back the first only, as
    Anthropic's disable_parallel_tool_use and gRPC's parallel_tool_calls do."""
    call = '<tool_call>\n{"name": "add", "arguments": {"a": %d}}\n</tool_call>'
    text = call % 1 + "\n" + call % 2
    extra = {"structured_outputs": {"regex": written(text)}}
    for parallel, count in [(None, 2), (False, 1)]:
        fields = {} if parallel is None else {"parallel_tool_calls": parallel}
        kw = dict(tools=[TOOLS[1]], max_tokens=120, extra_body=extra, **fields)
        if stream:
            state = ChatCompletionStreamState()
            for chunk in create(live_server, stream=True, **kw):
                state.handle_chunk(chunk)
            choice = state.get_final_completion().choices[0]
        else:
            choice = create(live_server, **kw).choices[0]
        calls = choice.message.tool_calls or []
        assert [json.loads(c.function.arguments)["a"] for c in calls] == [1, 2][:count]
        assert choice.finish_reason == "tool_calls"
