"""Tools on the gRPC surface, against a live server on the tiny random model with the
grpcio client: a forced call (required, or a named tool) comes back as a ToolCall whose
arguments parse and follow the tool's schema, with FINISH_REASON_TOOL_CALLS; mode none
parses nothing; bad tools and choices are INVALID_ARGUMENT."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from tests.live_server import MODEL_NAME
from zerohop.api.grpc_gen.zerohop.v1 import zerohop_pb2 as pb
from zerohop.api.grpc_gen.zerohop.v1 import zerohop_pb2_grpc as pb_grpc

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Oslo", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 3},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"],
    "additionalProperties": False,
}
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
