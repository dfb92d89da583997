"""Call grammars as agent frameworks need them: tool schemas with `$defs` / `$ref` (every
Pydantic model with a nested model or an Enum) compile and mean what they say once nested
under a call's `arguments`, and tools with an output format decode a call or else the answer
in the format, on the Anthropic and OpenAI surfaces (forced or auto)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from tests.grammar_check import decodes
from tests.live_server import MODEL_NAME, LiveServer
from zerohop.api.tools.forced import call_or_answer_grammar, forced_call_grammar
from zerohop.api.tools.spec import Tool
from zerohop.engine.structured import grammar as g

# What Pydantic writes for `class Weather(BaseModel): place: Place; unit: Unit` with a nested
# model and an Enum: root-relative references to `$defs`.
NESTED = {
    "$defs": {
        "Unit": {"enum": ["c", "f"], "title": "Unit", "type": "string"},
        "Place": {
            "properties": {"city": {"enum": ["Oslo", "Rome"]}, "unit": {"$ref": "#/$defs/Unit"}},
            "required": ["city", "unit"],
            "title": "Place",
            "type": "object",
        },
    },
    "properties": {"place": {"$ref": "#/$defs/Place"}},
    "required": ["place"],
    "title": "Weather",
    "type": "object",
}
# Another tool's `Unit` that means something else: the two must not be confused.
OTHER_UNIT = {
    "definitions": {"Unit": {"enum": ["kg"]}},
    "properties": {"unit": {"$ref": "#/definitions/Unit"}},
    "required": ["unit"],
    "type": "object",
}
# A tree: a reference to the root itself.
TREE = {
    "type": "object",
    "properties": {"label": {"enum": ["x"]}, "child": {"$ref": "#"}},
    "required": ["label"],
}
ANSWER = {"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"]}


def call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


GOOD_WEATHER = call("weather", {"place": {"city": "Oslo", "unit": "c"}})


def test_references_resolve_under_arguments(llama_dir: Path) -> None:
    grammar = forced_call_grammar([Tool("weather", parameters=NESTED)])
    assert decodes(llama_dir, grammar, GOOD_WEATHER)
    for bad in [{"place": {"city": "Oslo", "unit": "k"}}, {"place": {"city": "Oslo"}},
                {"place": "Oslo"}, {"place": {"city": "Oslo", "unit": "c", "x": 1}}]:  # fmt: skip
        assert not decodes(llama_dir, grammar, call("weather", bad)), bad


def test_two_tools_keep_their_own_definitions(llama_dir: Path) -> None:
    tools = [Tool("weather", parameters=NESTED), Tool("weigh", parameters=OTHER_UNIT)]
    grammar = forced_call_grammar(tools)
    assert decodes(llama_dir, grammar, GOOD_WEATHER)
    assert decodes(llama_dir, grammar, call("weigh", {"unit": "kg"}))
    assert not decodes(llama_dir, grammar, call("weigh", {"unit": "c"}))
    assert not decodes(llama_dir, grammar, call("weather", {"place": {"city": "Oslo",
                                                                      "unit": "kg"}}))  # fmt: skip


def test_a_reference_to_the_root_is_the_arguments(llama_dir: Path) -> None:
    grammar = forced_call_grammar([Tool("tree", parameters=TREE)])
    nested = {"label": "x", "child": {"label": "x", "child": {"label": "x"}}}
    assert decodes(llama_dir, grammar, call("tree", nested))
    assert not decodes(llama_dir, grammar, call("tree", {"label": "x", "child": {"child": {}}}))
    # the call object itself is not what `#` means
    assert not decodes(llama_dir, grammar, call("tree", {"label": "x", "child": {"name": "tree"}}))


@pytest.mark.parametrize("many", [False, True])
def test_a_call_or_else_the_answer(llama_dir: Path, many: bool) -> None:
    tools = [Tool("weather", parameters=NESTED)]
    grammar = call_or_answer_grammar(tools, g.json_schema_grammar(ANSWER), many)
    assert decodes(llama_dir, grammar, GOOD_WEATHER)
    assert decodes(llama_dir, grammar, '{"n": 2}')
    assert decodes(llama_dir, grammar, f"{GOOD_WEATHER}\n{GOOD_WEATHER}") is many
    for bad in ['{"n": 3}', "Sure.", f"Sure. {GOOD_WEATHER}", f'{GOOD_WEATHER}\n{{"n": 1}}']:
        assert not decodes(llama_dir, grammar, bad), bad


# -- on the surfaces -------------------------------------------------------------------------

OPENAI_TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": NESTED}}]
STRICT_OPENAI_TOOLS = [{"type": "function", "function": {
    "name": "weather", "parameters": NESTED, "strict": True}}]  # fmt: skip
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "n", "schema": ANSWER}}
USER = [{"role": "user", "content": "Weather in Oslo?"}]


def chat(server: LiveServer, **fields: Any) -> Any:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="any", max_retries=0)
    body = {"model": MODEL_NAME, "messages": USER, "max_tokens": 120, "n": 3, "seed": 5, **fields}
    return client.chat.completions.create(**body)


def check_call_or_answer(message: Any) -> str:
    """'call' or 'answer': the message is one of them, valid for its schema."""
    if message.tool_calls:
        for made in message.tool_calls:
            assert made.function.name == "weather"
            jsonschema.validate(json.loads(made.function.arguments), NESTED)
        return "call"
    jsonschema.validate(json.loads(message.content), ANSWER)
    return "answer"


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "weather"}}]
)
def test_openai_forced_nested_tool_validates(live_server: LiveServer, choice: Any) -> None:
    got = chat(live_server, tools=OPENAI_TOOLS, tool_choice=choice)
    for option in got.choices:
        assert option.finish_reason == "tool_calls", option
        assert check_call_or_answer(option.message) == "call"


@pytest.mark.parametrize("tools", [OPENAI_TOOLS, STRICT_OPENAI_TOOLS], ids=["loose", "strict"])
@pytest.mark.parametrize("choice", ["required", "auto"])
def test_openai_tools_with_a_response_format(
    live_server: LiveServer, tools: list, choice: str
) -> None:
    """The Agents SDK's output_type with tool_choice required, or auto: never a 400, each
    choice a valid call or a valid answer."""
    got = chat(live_server, tools=tools, tool_choice=choice, response_format=RESPONSE_FORMAT)
    kinds = {check_call_or_answer(option.message) for option in got.choices}
    assert kinds <= {"call", "answer"}
    for option in got.choices:
        expected = "tool_calls" if option.message.tool_calls else "stop"
        assert option.finish_reason == expected, option


def test_openai_strict_nested_tool_in_auto_mode(live_server: LiveServer) -> None:
    got = chat(live_server, tools=STRICT_OPENAI_TOOLS, max_tokens=60)
    for option in got.choices:
        for made in option.message.tool_calls or []:
            jsonschema.validate(json.loads(made.function.arguments), NESTED)


ANTHROPIC_TOOLS = [{"name": "weather", "input_schema": NESTED}]
OUTPUT_CONFIG = {"format": {"type": "json_schema", "schema": ANSWER}}


def messages(server: LiveServer, **fields: Any) -> Any:
    client = anthropic.Anthropic(base_url=server.url, api_key="any", max_retries=0)
    body = {"model": MODEL_NAME, "messages": USER, "max_tokens": 120, **fields}
    return client.messages.create(**body)


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "auto"}])
def test_anthropic_tools_with_an_output_format(live_server: LiveServer, choice: Any) -> None:
    got = messages(live_server, tools=ANTHROPIC_TOOLS, tool_choice=choice,
                   output_config=OUTPUT_CONFIG)  # fmt: skip
    uses = [b for b in got.content if b.type == "tool_use"]
    if uses:
        assert got.stop_reason == "tool_use"
        for use in uses:
            jsonschema.validate(use.input, NESTED)
    else:
        text = "".join(b.text for b in got.content if b.type == "text")
        jsonschema.validate(json.loads(text), ANSWER)
        assert got.stop_reason == "end_turn"


def test_anthropic_forced_nested_tool_streams_valid_input(live_server: LiveServer) -> None:
    client = anthropic.Anthropic(base_url=live_server.url, api_key="any", max_retries=0)
    with client.messages.stream(
        model=MODEL_NAME, messages=USER, max_tokens=120, tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "tool", "name": "weather"},
    ) as stream:  # fmt: skip
        final = stream.get_final_message()
    (use,) = [b for b in final.content if b.type == "tool_use"]
    jsonschema.validate(use.input, NESTED)
