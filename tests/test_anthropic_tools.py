"""Tool use on the Anthropic Messages surface, through the official SDK against a live
server on the tiny random model: forced calls (tool_choice any / tool) validate against the
tool's schema, streamed or not; a tool_result turn is accepted; tool_choice none calls
nothing; bad definitions are refused in Anthropic's error shape; count_tokens counts tools."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import msgspec
import pytest

from tests.live_server import MODEL_NAME, LiveServer
from zerohop.api.anthropic import schema as anthropic_schema
from zerohop.api.anthropic.blocks import ContentBlocks
from zerohop.api.anthropic.turns import conversation, request_tools
from zerohop.api.conversation.events import OutputReader
from zerohop.api.conversation.planner import strict_grammar
from zerohop.api.errors import ApiError
from zerohop.api.tools.hermes import HermesParser
from zerohop.api.tools.mistral import MistralParser
from zerohop.api.tools.spec import ToolSet

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "Oslo"]},
            "unit": {"enum": ["c", "f"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
CLOCK = {
    "name": "get_time",
    "description": "The time.",
    "input_schema": {
        "type": "object",
        "properties": {"zone": {"enum": ["utc", "cet"]}},
        "required": ["zone"],
    },
}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX = 256


def client(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="any", max_retries=0)


def check_call(message: Any, names: set[str]) -> None:
    assert message.stop_reason == "tool_use", message
    calls = [b for b in message.content if b.type == "tool_use"]
    assert len(calls) == 1, message.content
    call = calls[0]
    assert call.name in names and isinstance(call.input, dict)
    assert call.id.startswith("toolu_") and len(call.id) == 30 and call.id[6:].isalnum()
    jsonschema.validate(call.input, SCHEMAS[call.name])


CHOICES = {"any": ({"type": "any"}, {"get_weather", "get_time"}), "tool": (
    {"type": "tool", "name": "get_time"}, {"get_time"})}  # fmt: skip


@pytest.mark.parametrize("choice", list(CHOICES))
def test_forced_call(live_server, choice: str) -> None:
    tool_choice, names = CHOICES[choice]
    kw = dict(model=MODEL_NAME, max_tokens=MAX, messages=USER, tools=TOOLS)
    message = client(live_server).messages.create(**kw, tool_choice=tool_choice)
    check_call(message, names)
    with client(live_server).messages.stream(**kw, tool_choice=tool_choice) as stream:
        final = stream.get_final_message()
    check_call(final, names)
    plain = [b.model_dump(exclude={"id"}, exclude_none=True) for b in message.content]
    streamed = [b.model_dump(exclude={"id"}, exclude_none=True) for b in final.content]
    assert [b["type"] for b in plain] == [b["type"] for b in streamed]


def sse_events(lines: list[str]) -> list[tuple[str, dict]]:
    events, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[6:])))
    return events


def test_raw_stream_event_order(live_server) -> None:
    """A forced call streams as it is decoded: its block starts (input {}) once the name is
    read, then input_json_deltas whose partial_json joins to the input, then it stops."""
    body = {"model": MODEL_NAME, "max_tokens": MAX, "messages": USER, "stream": True}
    body |= {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "get_weather"}}
    with httpx.stream("POST", live_server.url + "/v1/messages", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = sse_events(list(r.iter_lines()))
    names = [n for n, _ in events if n != "ping"]
    deltas = [d for n, d in events if n == "content_block_delta"]
    assert len(deltas) > 1 and names == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * len(deltas),
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    data = dict(events)
    block = data["content_block_start"]
    assert block["index"] == 0 and block["content_block"]["input"] == {}
    assert block["content_block"]["type"] == "tool_use"
    assert block["content_block"]["name"] == "get_weather"
    assert {d["index"] for d in deltas} == {0}
    assert {d["delta"]["type"] for d in deltas} == {"input_json_delta"}
    partial = "".join(d["delta"]["partial_json"] for d in deltas)
    assert partial.startswith("{") and partial.endswith("}")
    jsonschema.validate(json.loads(partial), WEATHER["input_schema"])
    assert data["message_delta"]["delta"]["stop_reason"] == "tool_use"


BOOK = {
    "name": "book",
    "description": "Book a room.",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "Oslo"]},
            "note": {"type": "string", "maxLength": 24},
            "nights": {"type": "integer", "minimum": 1, "maximum": 9},
            "breakfast": {"type": "boolean"},
        },
        "required": ["city", "note", "nights", "breakfast"],
        "additionalProperties": False,
    },
}


def test_forced_call_streams_its_input_as_decoded(live_server) -> None:
    """Through the SDK's stream helper: several input_json events, and the final message's
    content is the whole response's (greedy decoding: the same call)."""
    kw = dict(model=MODEL_NAME, max_tokens=300, messages=USER, tools=[BOOK])
    kw["extra_body"] = {"temperature": 0}  # this SDK takes no temperature argument
    kw["tool_choice"] = {"type": "tool", "name": "book"}
    whole = client(live_server).messages.create(**kw)
    partials = []
    with client(live_server).messages.stream(**kw) as stream:
        for event in stream:
            if event.type == "input_json":
                partials.append(event.partial_json)
        final = stream.get_final_message()
    assert len(partials) > 1 and final.stop_reason == whole.stop_reason == "tool_use"
    (block,) = final.content
    assert block.type == "tool_use" and json.loads("".join(partials)) == block.input
    jsonschema.validate(block.input, BOOK["input_schema"])
    assert [b.model_dump(exclude={"id"}) for b in final.content] == [
        b.model_dump(exclude={"id"}) for b in whole.content
    ]


STRICT_BOOK = {**BOOK, "strict": True}


def test_strict_tools_in_auto_mode_decode_by_grammar(live_server) -> None:
    """Only when every tool is strict, in auto mode, read as Hermes, without a format, a
    prefill or thinking; then the model may write text but only valid calls."""

    def grammar(request: Any, parser: Any = HermesParser, think: bool | None = None) -> Any:
        conv = conversation(request, None)
        conv.reasoning.think = think
        return strict_grammar(conv, parser)

    request = decoded(tools=[STRICT_BOOK])
    assert grammar(request) is not None
    assert grammar(request, MistralParser) is None
    assert grammar(request, think=True) is None
    assert grammar(decoded(tools=[STRICT_BOOK, CLOCK])) is None
    prefilled = decoded(
        tools=[STRICT_BOOK], messages=[*USER, {"role": "assistant", "content": "I"}]
    )
    assert grammar(prefilled) is None
    assert grammar(decoded(tools=[STRICT_BOOK], tool_choice={"type": "any"})) is None
    message = client(live_server).messages.create(
        model=MODEL_NAME, max_tokens=24, messages=USER, tools=[STRICT_BOOK]
    )
    assert message.stop_reason in ("end_turn", "max_tokens", "tool_use")
    for block in message.content:
        if block.type == "tool_use":
            jsonschema.validate(block.input, BOOK["input_schema"])


def test_second_turn_with_tool_result(live_server) -> None:
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris", "unit": "c"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C, sunny"},
                {"type": "text", "text": "And now?"},
            ],
        },
    ]  # fmt: skip
    message = client(live_server).messages.create(
        model=MODEL_NAME, max_tokens=8, messages=messages, tools=TOOLS
    )
    assert message.type == "message"
    error = {**messages[2], "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "no"}], "is_error": True}]}  # fmt: skip
    message = client(live_server).messages.create(
        model=MODEL_NAME, max_tokens=8, messages=[*messages[:2], error], tools=TOOLS
    )
    assert message.type == "message"


def test_tool_choice_none_calls_nothing(live_server) -> None:
    message = client(live_server).messages.create(
        model=MODEL_NAME, max_tokens=16, messages=USER, tools=TOOLS, tool_choice={"type": "none"}
    )
    assert [b.type for b in message.content] == ["text"]
    assert message.stop_reason in ("end_turn", "max_tokens")


def test_count_tokens_counts_tools(live_server) -> None:
    count = client(live_server).messages.count_tokens
    without = count(model=MODEL_NAME, messages=USER).input_tokens
    assert count(model=MODEL_NAME, messages=USER, tools=TOOLS).input_tokens > without


UNIQUE = {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}
ORPHAN = [
    *USER,
    {"role": "assistant", "content": "ok"},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]},
]
BAD = {
    "bad name": ({"tools": [{**WEATHER, "name": "no spaces"}]}, "tools.0.name"),
    "duplicate": ({"tools": [WEATHER, WEATHER]}, "used twice"),
    "no schema": ({"tools": [{"name": "f"}]}, "tools.0.input_schema: Field required"),
    "array schema": ({"tools": [{"name": "f", "input_schema": {"type": "array"}}]}, "'object'"),
    "server tool": ({"tools": [{"type": "web_search_x", "name": "w"}]}, "server tools"),
    "unknown choice": ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
                       "no tool named 'nope'"),
    "any without tools": ({"tool_choice": {"type": "any"}}, "at least one tool"),
    "bad choice type": ({"tools": TOOLS, "tool_choice": {"type": "some"}}, "tool_choice"),
    "orphan result": ({"tools": TOOLS, "messages": ORPHAN}, "unexpected `tool_use_id`"),
    "blocks without tools": ({"messages": ORPHAN}, "must define tools"),
    "forced uncompilable": ({"tool_choice": {"type": "any"}, "tools": [{"name": "f",
        "input_schema": UNIQUE}]}, "tools: the grammar cannot be compiled: "),
    "strict uncompilable": ({"tools": [{"name": "f", "input_schema": UNIQUE, "strict": True}]},
                            '["uniqueItems"]'),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_bad_requests(live_server, case: str) -> None:
    fields, words = BAD[case]
    body = {"model": MODEL_NAME, "max_tokens": 8, "messages": USER, **fields}
    response = httpx.post(live_server.url + "/v1/messages", json=body, timeout=30)
    assert response.status_code == 400, response.text
    payload = response.json()
    assert payload["type"] == "error"
    assert payload["error"]["type"] == "invalid_request_error"
    assert words in payload["error"]["message"], payload
    assert payload["request_id"] == response.headers["request-id"]


def test_a_tool_schema_that_is_not_a_json_schema_is_a_400(live_server) -> None:
    schema = {"type": "object", "required": "city"}
    with pytest.raises(anthropic.BadRequestError) as info:
        client(live_server).messages.create(
            model=MODEL_NAME,
            max_tokens=2,
            messages=USER,
            tools=[{"name": "f", "input_schema": schema}],
        )
    error = info.value.body["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("tools.0.input_schema: not a valid JSON schema: ")


def decoded(**fields: Any) -> anthropic_schema.MessagesRequest:
    body = {"model": MODEL_NAME, "max_tokens": 8, "messages": USER, "tools": TOOLS, **fields}
    return anthropic_schema.decode_messages(json.dumps(body).encode())


def tool_reader(request: anthropic_schema.MessagesRequest) -> tuple[OutputReader, ContentBlocks]:
    """The reader and blocks of a request in auto mode, calls read as Hermes."""
    conv = conversation(request, None)
    calls = HermesParser(ToolSet(conv.tools))
    return OutputReader(None, calls, not conv.tool_choice.parallel), ContentBlocks(False, True)


def test_neutral_turns_and_parsing() -> None:
    messages = [
        *USER,
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1",
                                           "name": "get_time", "input": {"zone": "utc"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": "12:00"}]},
    ]  # fmt: skip
    conv = conversation(decoded(messages=messages, system="Be brief."), None)
    assert conv.prefill is None
    assert [turn.as_template() for turn in conv.turns] == [
        {"role": "system", "content": "Be brief."},
        USER[0],
        {"role": "assistant", "content": "", "tool_calls": [
            {"name": "get_time", "arguments": {"zone": "utc"}}]},
        {"role": "tool", "content": "12:00", "name": "get_time"},
    ]  # fmt: skip
    request = decoded(tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    reader, output = tool_reader(request)
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "cet"}}\n</tool_call>'
    for piece in ["Sure.\n", call[:7], call[7:], "\n", call, " after"]:
        output.events(reader.feed(piece))
    output.events(reader.feed("", final=True), final=True)
    content = output.content()
    assert [b["type"] for b in content] == ["text", "tool_use"]  # one call only, then no text
    assert content[0]["text"] == "Sure.\n" and content[1]["input"] == {"zone": "cet"}
    with pytest.raises(ApiError, match="used twice"):
        request_tools(decoded(tools=[CLOCK, CLOCK]))


def test_stream_events_accumulate_to_the_content() -> None:
    """Text then two calls, through the SDK's own stream accumulator: the same content as
    the non-streaming response, block indexes consecutive, each block stopped once."""
    from anthropic.lib.streaming._messages import accumulate_event

    reader, blocks = tool_reader(decoded(tool_choice={"type": "auto"}))
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "cet"}}\n</tool_call>'
    raw = b""
    pieces = ["\n", "Sure", ".\n", call[:5], call[5:], "\n", call]
    for i, piece in enumerate(pieces):
        final = i == len(pieces) - 1
        raw += blocks.events(reader.feed(piece, final=final), final=final)
    raw += blocks.end()
    events = sse_events(raw.decode().splitlines())
    kinds = [(n, d.get("index")) for n, d in events if n != "content_block_delta"]
    assert kinds == [("content_block_start", 0), ("content_block_stop", 0),
                     ("content_block_start", 1), ("content_block_stop", 1),
                     ("content_block_start", 2), ("content_block_stop", 2)]  # fmt: skip
    start = {"type": "message_start", "message": {"id": "msg_1", "type": "message",
             "role": "assistant", "model": MODEL_NAME, "content": [], "stop_reason": None,
             "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 0}}}  # fmt: skip
    snapshot, bufs = None, {}
    for data in [start] + [d for _, d in events]:
        snapshot = accumulate_event(event=data, current_snapshot=snapshot, json_bufs=bufs)
    got = [b.model_dump(exclude_none=True) for b in snapshot.content]
    want = blocks.content()
    assert [{k: b[k] for k in w} for b, w in zip(got, want, strict=True)] == want
    assert want[0] == {"type": "text", "text": "\nSure.\n"} and len(want) == 3


def test_new_structs_take_null_as_absent() -> None:
    minimal = {
        anthropic_schema.ToolDef: {"name": "f", "input_schema": {"type": "object"}},
        anthropic_schema.ToolUseBlock: {"type": "tool_use", "id": "t", "name": "f", "input": {}},
        anthropic_schema.ToolResultBlock: {"type": "tool_result", "tool_use_id": "t"},
        anthropic_schema.ChoiceAuto: {"type": "auto"},
        anthropic_schema.ChoiceTool: {"type": "tool", "name": "f"},
    }
    for kind, body in minimal.items():
        decoder = msgspec.json.Decoder(kind)
        absent = decoder.decode(json.dumps(body))
        for f in msgspec.structs.fields(kind):
            if f.required is False and f.name not in body:
                assert decoder.decode(json.dumps({**body, f.name: None})) == absent, f.name
