"""The gRPC surface on the shared conversation spine (api/conversation), against a live server
on the tiny random model with the grpcio client: `Tool.strict` reaches the planner's auto-call
grammar, a forced call streams as it is decoded (`tool_call_deltas`) and still comes whole in
`tool_calls`, `ToolChoice.parallel_tool_calls` keeps the first call, and CountTokens plans a
`messages` request as Generate does (same prompt, same refusals)."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest
from tokenizers import Tokenizer

from tests.fixtures.tool_schemas import ADD, WEATHER
from tests.live_server import MODEL_NAME
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2 as pb
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2_grpc as pb_grpc

SCHEMAS = {"get_weather": WEATHER, "add": ADD}
CHAT = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Weather in Oslo?")])
# A schema the JSON Schema checks accept but the call grammar cannot compile (llguidance).
UNCOMPILABLE = {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}


def _tools(strict: bool = False) -> list[pb.Tool]:
    return [
        pb.Tool(name=name, parameters_json=json.dumps(schema), strict=strict)
        for name, schema in SCHEMAS.items()
    ]


@pytest.fixture(scope="module")
def stub(live_server):
    with grpc.insecure_channel(f"127.0.0.1:{live_server.grpc_port}") as channel:
        yield pb_grpc.ZerohopStub(channel)


@pytest.fixture(scope="module")
def tokenizer(llama_dir) -> Tokenizer:
    return Tokenizer.from_file(str(llama_dir / "tokenizer.json"))


def _fields(fields: dict) -> dict:
    """The defaults and `fields`; a None field is left unset (`messages: None`)."""
    fields = {"model": MODEL_NAME, "messages": CHAT, "tools": _tools(), **fields}
    return {k: v for k, v in fields.items() if v is not None}


def _request(**fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(**_fields({"temperature": 0.0, "max_tokens": 200, **fields}))


def _generate(stub, request) -> list[pb.GenerateResponse]:
    return list(stub.Generate(request, timeout=120))


def _written(text: str) -> pb.Constraint:
    """A regex under which the model writes exactly `text`."""
    return pb.Constraint(regex="".join("\\" + c if c in r"\.^$*+?()[]{}|/" else c for c in text))


def _invalid_argument(call) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return info.value.details()


# -- strict tools ------------------------------------------------------------------------


def _after_an_open_tag(stub, tokenizer: Tokenizer, strict: bool) -> list[pb.GenerateResponse]:
    """What the model writes once its answer has opened a call: the answer is continued from
    `<tool_call>` (continue_token_ids, as a client's failover sends them), which the grammar
    consumes as the engine resumes and the call reader reads first, without output for it."""
    opened = tokenizer.encode("<tool_call>", add_special_tokens=False).ids
    request = _request(tools=_tools(strict), continue_token_ids=opened, seed=3)
    return _generate(stub, request)


def test_strict_tools_in_auto_mode_write_only_valid_calls(stub, tokenizer) -> None:
    """Only strict tools in auto mode: the model's call can only go on as a valid one (the
    planner's auto-call grammar), and the continued open tag makes it a call; without strict
    the random model writes anything, which is no valid call, so it stays text."""
    strict = _after_an_open_tag(stub, tokenizer, strict=True)
    [call] = [c for r in strict for c in r.tool_calls]
    jsonschema.validate(json.loads(call.arguments_json), SCHEMAS[call.name])
    loose = _after_an_open_tag(stub, tokenizer, strict=False)
    assert not [c for r in loose for c in r.tool_calls]
    assert "".join(r.text for r in loose)


def test_strict_tools_build_their_grammar(stub) -> None:
    """Observable from outside: a strict tool's call grammar is compiled in auto mode (a
    schema it cannot compile is refused), a tool that is not strict is not constrained."""
    tool = pb.Tool(name="x", parameters_json=json.dumps(UNCOMPILABLE))
    responses = _generate(stub, _request(tools=[tool], max_tokens=4))
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    tool.strict = True
    words = _invalid_argument(lambda: _generate(stub, _request(tools=[tool], max_tokens=4)))
    assert "uniqueItems" in words


def test_a_forced_call_whose_grammar_cannot_compile_is_invalid_argument(stub) -> None:
    tools = [pb.Tool(name="x", parameters_json=json.dumps(UNCOMPILABLE))]
    choice = pb.ToolChoice(name="x")
    words = _invalid_argument(lambda: _generate(stub, _request(tools=tools, tool_choice=choice)))
    assert "grammar cannot be compiled" in words


# -- streamed calls ----------------------------------------------------------------------


def test_a_required_call_streams_then_ends_whole(stub) -> None:
    """Mode required: the first delta names the call and gives its id, the later ones carry
    its arguments piece by piece; the whole call (same id) comes in tool_calls, once, and a
    client that reads only tool_calls sees what it always saw."""
    choice = pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED)
    responses = _generate(stub, _request(tool_choice=choice, seed=1))
    deltas = [d for r in responses for d in r.tool_call_deltas]
    calls = [c for r in responses for c in r.tool_calls]
    (call,) = calls
    first, rest = deltas[0], deltas[1:]
    assert (first.index, first.id, first.name) == (0, call.id, call.name)
    assert not first.arguments_json_fragment and rest
    assert all(d.index == 0 and not d.id and not d.name for d in rest)
    assert json.loads("".join(d.arguments_json_fragment for d in rest)) == json.loads(
        call.arguments_json
    )
    jsonschema.validate(json.loads(call.arguments_json), SCHEMAS[call.name])
    assert "".join(r.text for r in responses).strip() == ""
    assert responses[-1].finish_reason == pb.FINISH_REASON_TOOL_CALLS


def test_an_auto_mode_call_comes_whole(stub) -> None:
    """A call the model writes on its own is read once whole and valid: no deltas."""
    body = json.dumps({"name": "add", "arguments": {"a": 4}})
    request = _request(constraint=_written(f"<tool_call>\n{body}\n</tool_call>"))
    responses = _generate(stub, request)
    assert not any(r.tool_call_deltas for r in responses)
    assert [c.name for r in responses for c in r.tool_calls] == ["add"]
    assert responses[-1].finish_reason == pb.FINISH_REASON_TOOL_CALLS


# -- parallel calls ----------------------------------------------------------------------


@pytest.mark.parametrize(("parallel", "kept"), [(None, [1, 2, 3]), (True, [1, 2, 3]), (False, [1])])
def test_parallel_tool_calls(stub, parallel: bool | None, kept: list[int]) -> None:
    """Unset or true: every call; false: the first only (the others are dropped, not text)."""
    call = '<tool_call>\n{"name": "add", "arguments": {"a": %d}}\n</tool_call>'
    choice = pb.ToolChoice()
    if parallel is not None:
        choice.parallel_tool_calls = parallel
    constraint = _written("\n".join(call % a for a in (1, 2, 3)))
    responses = _generate(stub, _request(constraint=constraint, tool_choice=choice))
    calls = [c for r in responses for c in r.tool_calls]
    assert [json.loads(c.arguments_json)["a"] for c in calls] == kept
    assert "tool_call" not in "".join(r.text for r in responses)
    assert responses[-1].finish_reason == pb.FINISH_REASON_TOOL_CALLS


# -- CountTokens plans as Generate does --------------------------------------------------


def _count(stub, **fields) -> int:
    request = pb.CountTokensRequest(**_fields(fields))
    return stub.CountTokens(request, timeout=60).input_tokens


@pytest.mark.parametrize(
    "choice",
    [
        pb.ToolChoice(),
        pb.ToolChoice(name="add"),
        pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NONE),
    ],
    ids=["auto", "named", "none"],
)
def test_count_tokens_is_the_planned_prompt(stub, choice) -> None:
    responses = _generate(stub, _request(tool_choice=choice, max_tokens=2, seed=1))
    assert responses[-1].usage.prompt_tokens == _count(stub, tool_choice=choice)


def test_mode_none_offers_no_tools(stub) -> None:
    none = pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NONE)
    assert _count(stub, tool_choice=none) == _count(stub, tools=[]) < _count(stub)


REFUSED = {
    "unknown name": ({"tool_choice": pb.ToolChoice(name="nope")}, "no tool named 'nope'"),
    "forced without tools": (
        {"tools": [], "tool_choice": pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED)},
        "requires tools",
    ),
    "none naming a tool": (
        {"tool_choice": pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NONE, name="add")},
        "mode none cannot name a tool",
    ),
    "bad tool in mode none": (
        {
            "tools": [pb.Tool(name="no spaces")],
            "tool_choice": pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NONE),
        },
        "tools[0].name",
    ),
    "uncompilable forced call": (
        {
            "tools": [pb.Tool(name="x", parameters_json=json.dumps(UNCOMPILABLE))],
            "tool_choice": pb.ToolChoice(name="x"),
        },
        "grammar cannot be compiled",
    ),
    "a forced call without messages": (
        {"messages": None, "prompt": "hi", "tools": [], "tool_choice": pb.ToolChoice(name="x")},
        "requires tools",
    ),
}


@pytest.mark.parametrize(("fields", "words"), REFUSED.values(), ids=REFUSED.keys())
def test_count_tokens_refuses_what_generate_refuses(stub, fields, words) -> None:
    for call in (lambda: _generate(stub, _request(**fields)), lambda: _count(stub, **fields)):
        assert words in _invalid_argument(call)
