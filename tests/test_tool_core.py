"""zerohop/api/tools: the Hermes parser in any split, tool definition checks, and the forced
call's grammar (it compiles, and a valid call parses back)."""

from __future__ import annotations

import random

import pytest

from zerohop.api.tools.forced import forced_call_grammar
from zerohop.api.tools.hermes import HermesParser
from zerohop.api.tools.prompt import render_messages
from zerohop.api.tools.spec import Tool, checked_tools
from zerohop.engine.errors import InvalidRequestError
from zerohop.engine.structured.grammar import check_grammar

NAMES = {"get_weather", "add"}
TEXT = (
    'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    ' and <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> done <tool'
)


def parse_in_pieces(text: str, cuts: list[int]) -> tuple[str, list]:
    parser = HermesParser(NAMES)
    out_text, calls, last = "", [], 0
    for cut in [*cuts, len(text)]:
        parsed = parser.feed(text[last:cut])
        out_text, last = out_text + parsed.text, cut
        calls += parsed.calls
    out_text += parser.finish().text
    return out_text, calls


def test_any_split_gives_the_same_result() -> None:
    whole = parse_in_pieces(TEXT, [])
    assert whole[0] == "Sure.  and  done <tool"
    assert [(c.name, c.arguments) for c in whole[1]] == [
        ("get_weather", {"city": "Oslo"}),
        ("add", {"a": 1, "b": 2}),
    ]
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(len(TEXT)), rng.randint(1, 20)))
        assert parse_in_pieces(TEXT, cuts) == whole


def test_a_partial_tag_is_held_back() -> None:
    parser = HermesParser(NAMES)
    assert parser.feed("hi <tool_c").text == "hi "
    assert parser.feed("x").text == "<tool_cx"
    assert parser.finish().text == ""


@pytest.mark.parametrize(
    "body",
    ["{not json}", '{"name": "nope", "arguments": {}}', '{"name": "add", "arguments": [1]}'],
)
def test_a_bad_call_comes_back_as_text(body: str) -> None:
    parser = HermesParser(NAMES)
    text = f"<tool_call>{body}</tool_call>"
    parsed = parser.feed(text)
    assert parsed.calls == [] and parsed.text == text


def test_an_unclosed_call_is_text_at_the_end() -> None:
    parser = HermesParser(NAMES)
    assert parser.feed('<tool_call>{"name": "add"').text == ""
    assert parser.finish().text == '<tool_call>{"name": "add"'


@pytest.mark.parametrize(
    ("tools", "words"),
    [
        ([Tool("bad name")], "must be 1 to 64"),
        ([Tool("x" * 65)], "must be 1 to 64"),
        ([Tool("a"), Tool("a")], "used twice"),
        ([Tool("a", parameters={"type": "array"})], "type must be 'object'"),
        ([Tool("a", parameters=[1])], "must be a JSON object"),  # type: ignore[arg-type]
        (
            [Tool("a"), Tool("b", parameters={"properties": {"x": {"type": "strng"}}})],
            r"tools\[1\]\.parameters: not a valid JSON schema: .* \(at \.properties\.x\.type\)",
        ),
        ([Tool("a", parameters={"required": "x"})], "not a valid JSON schema"),
    ],
)
def test_checked_tools_refuses(tools: list[Tool], words: str) -> None:
    with pytest.raises(InvalidRequestError, match=words):
        checked_tools(tools)


def test_forced_grammar_compiles() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    grammar = forced_call_grammar([Tool("get_weather", parameters=schema), Tool("add")])
    check_grammar(grammar)  # raises with the backend's reason


def test_fallback_rendering_without_a_template() -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "add", "arguments": {}}]},
        {"role": "tool", "content": "3", "name": "add"},
    ]
    out, extra = render_messages(messages, [Tool("add")], None)
    assert extra == {} and out[0]["role"] == "system" and "<tools>" in out[0]["content"]
    assert "<tool_call>" in out[2]["content"] and "<tool_response>" in out[3]["content"]
