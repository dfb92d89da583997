"""Tools on the gRPC surface, against a live server on the tiny random model with the
grpcio client: a forced call (required, or a named tool) comes back as a ToolCall whose
arguments parse and follow the tool's schema, with FINISH_REASON_TOOL_CALLS; mode none
parses nothing; bad tools and choices are INVALID_ARGUMENT. The conversation goes back with
the assistant's calls and their results (tool_call_id), and CountTokens counts tools and
turns as Generate renders them; bad calls and results are INVALID_ARGUMENT."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from tests.fixtures.tool_schemas import ADD, WEATHER
from tests.live_server import MODEL_NAME
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2 as pb
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2_grpc as pb_grpc

SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [
    pb.Tool(name="get_weather", description="Weather.", parameters_json=json.dumps(WEATHER)),
    pb.Tool(name="add", parameters_json=json.dumps(ADD)),
]
ARRAY = pb.Tool(name="x", parameters_json='{"type": "array"}')
CHAT = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Weather in Oslo?")])


@pytest.fixture(scope="module")
def stub(live_server):
    with grpc.insecure_channel(f"127.0.0.1:{live_server.grpc_port}") as channel:
        yield pb_grpc.ZerohopStub(channel)


def _request(**fields) -> pb.GenerateRequest:
    fields = {"model": MODEL_NAME, "messages": CHAT, "tools": TOOLS, "max_tokens": 200, **fields}
    return pb.GenerateRequest(temperature=0.0, **{k: v for k, v in fields.items() if v is not None})


def _generate(stub, request) -> tuple[str, list[pb.ToolCall], list[pb.GenerateResponse]]:
    responses = list(stub.Generate(request, timeout=120))
    text = "".join(r.text for r in responses)
    return text, [c for r in responses for c in r.tool_calls], responses


@pytest.mark.parametrize(
    ("choice", "name"),
    [(pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED), None), (pb.ToolChoice(name="add"), "add")],
)
def test_a_forced_call_is_a_valid_tool_call(stub, choice, name) -> None:
    text, calls, responses = _generate(stub, _request(tool_choice=choice, seed=1))
    assert len(calls) == 1 and text.strip() == ""
    call = calls[0]
    assert call.id.startswith("call_") and len(call.id) == 29
    assert name is None or call.name == name
    jsonschema.validate(json.loads(call.arguments_json), SCHEMAS[call.name])
    assert responses[-1].finish_reason == pb.FINISH_REASON_TOOL_CALLS
    assert sum(len(r.token_ids) for r in responses) == responses[-1].usage.completion_tokens


def test_mode_none_parses_nothing(stub) -> None:
    choice = pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NONE)
    _, calls, responses = _generate(stub, _request(tool_choice=choice, max_tokens=8))
    assert not calls and responses[-1].finish_reason != pb.FINISH_REASON_TOOL_CALLS


def test_auto_mode_streams_text(stub) -> None:
    _, calls, responses = _generate(stub, _request(max_tokens=8, seed=3))
    assert responses[-1].finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    assert not calls and responses[-1].usage.completion_tokens >= 1


def _written(text: str) -> pb.Constraint:
    """A regex under which the model writes exactly `text` (the random model never writes a
    call of its own accord)."""
    return pb.Constraint(regex="".join("\\" + c if c in r"\.^$*+?()[]{}|/" else c for c in text))


@pytest.mark.parametrize(("days", "is_call"), [(2, True), (9, False)])  # days: 1 to 3
def test_auto_mode_reads_calls_that_validate(stub, days: int, is_call: bool) -> None:
    body = json.dumps({"name": "get_weather", "arguments": {"city": "Oslo", "days": days}})
    written = f"<tool_call>\n{body}\n</tool_call>"
    text, calls, responses = _generate(stub, _request(constraint=_written(written)))
    if is_call:
        assert text == "" and [c.name for c in calls] == ["get_weather"]
        assert json.loads(calls[0].arguments_json) == {"city": "Oslo", "days": 2}
        assert responses[-1].finish_reason == pb.FINISH_REASON_TOOL_CALLS
    else:
        assert text == written and not calls
        assert responses[-1].finish_reason == pb.FINISH_REASON_STOP


BAD = {
    "text prompt": ({"messages": None, "prompt": "hi"}, "messages prompt"),
    "bad name": ({"tools": [pb.Tool(name="no spaces")]}, "tools[0].name"),
    "duplicate": ({"tools": [TOOLS[1], TOOLS[1]]}, "used twice"),
    "not JSON": ({"tools": [pb.Tool(name="x", parameters_json="{")]}, "not JSON"),
    "not an object": ({"tools": [ARRAY]}, "'object'"),
    "unknown choice": ({"tool_choice": pb.ToolChoice(name="nope")}, "no tool named 'nope'"),
    "forced without tools": (
        {"tools": [], "tool_choice": pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED)},
        "requires tools",
    ),
    "forced with a constraint": (
        {
            "tool_choice": pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED),
            "constraint": pb.Constraint(regex="a+"),
        },
        "constraint",
    ),
}


@pytest.mark.parametrize(("fields", "words"), BAD.values(), ids=BAD.keys())
def test_bad_tools_are_invalid_argument(stub, fields, words) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(_request(**fields), timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in info.value.details()


def _conversation(call: pb.ToolCall, result: str) -> pb.ChatMessages:
    """The user's question, the assistant's call as it came back, and the call's result."""
    return pb.ChatMessages(
        messages=[
            CHAT.messages[0],
            pb.ChatMessage(role="assistant", tool_calls=[call]),
            pb.ChatMessage(role="tool", tool_call_id=call.id, content=result),
        ]
    )


def _count(stub, messages: pb.ChatMessages, tools=TOOLS) -> int:
    request = pb.CountTokensRequest(model=MODEL_NAME, messages=messages, tools=tools)
    return stub.CountTokens(request, timeout=60).input_tokens


def test_a_tool_result_is_sent_back_and_answered(stub) -> None:
    choice = pb.ToolChoice(name="get_weather")
    _, calls, _ = _generate(stub, _request(tool_choice=choice, seed=1))
    short = _conversation(calls[0], "sunny")
    long = _conversation(calls[0], "sunny, 21 degrees, a light wind from the west, no rain")
    # The tools, the call and the result are all in the prompt: each adds tokens.
    assert _count(stub, CHAT, tools=[]) < _count(stub, CHAT) < _count(stub, short)
    assert _count(stub, short) < _count(stub, long)
    _, more, responses = _generate(stub, _request(messages=long, max_tokens=8, seed=2))
    last = responses[-1]
    assert last.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    assert not more and last.usage.completion_tokens >= 1
    assert last.usage.prompt_tokens == _count(stub, long)


def test_tool_turns_without_tools_render(stub) -> None:
    """A final answer may be asked for without offering the tools again."""
    call = pb.ToolCall(id="call_1", name="add", arguments_json='{"a": 1}')
    messages = _conversation(call, "1")
    _, _, responses = _generate(stub, _request(messages=messages, tools=[], max_tokens=4))
    assert responses[-1].usage.prompt_tokens == _count(stub, messages, tools=[])


def _turns(arguments: str = '{"a": 1}', answers: str = "call_1", role: str = "assistant"):
    call = pb.ToolCall(id="call_1", name="add", arguments_json=arguments)
    return pb.ChatMessages(
        messages=[
            CHAT.messages[0],
            pb.ChatMessage(role=role, tool_calls=[call]),
            pb.ChatMessage(role="tool", tool_call_id=answers, content="1"),
        ]
    )


BAD_TURNS = {
    "arguments not an object": (_turns(arguments="[1]"), "must be a JSON object"),
    "arguments not JSON": (_turns(arguments="{"), "not valid JSON"),
    "result of no call": (_turns(answers="call_2"), "'call_2' answers no earlier tool call"),
    "result without an id": (_turns(answers=""), "answers no earlier tool call"),
    "calls on a user turn": (_turns(role="user"), "only assistant messages"),
}


@pytest.mark.parametrize(("messages", "words"), BAD_TURNS.values(), ids=BAD_TURNS.keys())
def test_bad_tool_turns_are_invalid_argument(stub, messages, words) -> None:
    calls = [
        lambda: list(stub.Generate(_request(messages=messages), timeout=60)),
        lambda: _count(stub, messages),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in info.value.details()


def test_parallel_tool_calls_false_keeps_the_first_call(stub) -> None:
    call = '<tool_call>\n{"name": "add", "arguments": {"a": %d}}\n</tool_call>'
    constraint = _written(call % 1 + "\n" + call % 2)
    for parallel, count in [(None, 2), (False, 1)]:
        choice = (
            pb.ToolChoice() if parallel is None else pb.ToolChoice(parallel_tool_calls=parallel)
        )
        _, calls, responses = _generate(stub, _request(constraint=constraint, tool_choice=choice))
        assert [json.loads(c.arguments_json)["a"] for c in calls] == [1, 2][:count]
        assert responses[-1].finish_reason == pb.FINISH_REASON_TOOL_CALLS


def test_a_forced_call_streams_as_it_is_decoded(stub) -> None:
    """The call's id and name first, then its arguments piece by piece; the whole call, with
    the same id, where it ends."""
    choice = pb.ToolChoice(name="add")
    _, calls, responses = _generate(stub, _request(tool_choice=choice, seed=1))
    deltas = [(i, d) for i, r in enumerate(responses) for d in r.tool_call_deltas]
    (first_at, first), rest = deltas[0], [d for _, d in deltas[1:]]
    assert first.name == "add" and first.id.startswith("call_") and not rest[0].name
    (call,) = calls
    assert call.id == first.id
    streamed = "".join(d.arguments_json_fragment for d in rest)
    assert json.loads(streamed) == json.loads(call.arguments_json)
    ended = next(i for i, r in enumerate(responses) if r.tool_calls)
    assert first_at < ended  # the call was on its way before it was whole


def test_strict_tools_in_auto_mode_decode_by_grammar(stub) -> None:
    """`strict` reaches the planner: only strict tools in auto mode decode by the grammar that
    admits text but only valid calls (as on the other surfaces)."""
    from zerohop.api.conversation.planner import grammar
    from zerohop.api.grpc.tools import conversation
    from zerohop.api.tools.forced import auto_call_grammar
    from zerohop.api.tools.hermes import HermesParser

    strict = [pb.Tool(name=t.name, parameters_json=t.parameters_json, strict=True) for t in TOOLS]
    conv = conversation(_request(tools=strict))
    assert all(t.strict for t in conv.tools)
    assert grammar(conv, HermesParser) == auto_call_grammar(conv.tools)
    assert grammar(conversation(_request(tools=[strict[0], TOOLS[1]])), HermesParser) is None
    _, calls, responses = _generate(stub, _request(tools=strict, max_tokens=24, seed=3))
    for call in calls:
        jsonschema.validate(json.loads(call.arguments_json), SCHEMAS[call.name])
    assert responses[-1].usage.completion_tokens >= 1
