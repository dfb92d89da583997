"""zerohop/api/tools: the Hermes parser in any split, tool definition checks, the forced
call's grammar (it compiles, and a valid call parses back) and the forced call read as it
is decoded (its name first, then its arguments' exact text piece by piece)."""

from __future__ import annotations

import random

import pytest

from zerohop.api.tools.forced import forced_call_grammar
from zerohop.api.tools.forced_stream import ForcedCallParser
from zerohop.api.tools.hermes import HermesParser
from zerohop.api.tools.jsonscan import INCOMPLETE, ValueScanner, value_end
from zerohop.api.tools.prompt import render_messages
from zerohop.api.tools.spec import Tool, checked_tools
from zerohop.engine.base.errors import InvalidRequestError
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


ARGUMENTS = '{\n  "city": "O}s\\"lo",\n  "days": [1, {"x": 2}]\n}'
FORCED = f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGUMENTS}\n}}\n</tool_call>'


def stream_forced(pieces: list[str]) -> tuple[list[str | None], str, list, str]:
    """(the names opened, the fragments joined, the calls, the text) of a forced output."""
    parser = ForcedCallParser(NAMES)
    opened, fragments, calls, text = [], "", [], ""
    for piece in [*pieces, None]:
        parsed = parser.feed(piece) if piece is not None else parser.finish()
        opened += [parsed.opened] if parsed.opened else []
        assert not (parsed.fragment and not opened), "a fragment before the call's name"
        fragments, text = fragments + parsed.fragment, text + parsed.text
        calls += [(c.name, c.arguments) for c in parsed.calls]
    return opened, fragments, calls, text


def test_a_forced_call_streams_its_arguments_text_in_any_split() -> None:
    whole = stream_forced([FORCED])
    assert whole == (
        ["get_weather"],
        ARGUMENTS,
        [("get_weather", {"city": 'O}s"lo', "days": [1, {"x": 2}]})],
        "",
    )
    rng = random.Random(1)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(FORCED)), rng.randint(1, 30)))
        pieces = [FORCED[a:b] for a, b in zip([0, *cuts], [*cuts, len(FORCED)], strict=True)]
        assert stream_forced(pieces) == whole
    assert stream_forced(list(FORCED)) == whole


def test_the_name_is_given_out_before_the_arguments_begin() -> None:
    parser = ForcedCallParser(NAMES)
    assert parser.feed('<tool_call>\n{"name": "add').opened is None
    assert parser.feed('"').opened == "add"
    assert parser.feed(', "arguments": ').fragment == ""
    assert parser.feed('{"a"').fragment == '{"a"'


def test_a_forced_call_laid_out_otherwise_is_read_whole() -> None:
    other = '<tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call>'
    assert stream_forced(list(other)) == ([], "", [("add", {"a": 1})], "")
    assert stream_forced(["plain"]) == ([], "", [], "plain")


def test_a_forced_call_cut_short_is_dropped_once_begun() -> None:
    cut = FORCED.index('"days"')
    assert stream_forced([FORCED[:cut]]) == (["get_weather"], ARGUMENTS[:25], [], "")
    assert stream_forced(["<tool_call>\n{"]) == ([], "", [], "<tool_call>\n{")


def scanned_in_two(text: str, cut: int) -> int:
    scanner = ValueScanner()
    first = scanner.feed(text[:cut])
    if first != INCOMPLETE:
        return first
    second = scanner.feed(text[cut:])
    return second + cut if second >= 0 else second


def test_value_scanner_finds_the_end_as_value_end_does() -> None:
    texts = [ARGUMENTS + " tail", "[1, [2]]]", "{]", "x{}", '{"a": "\\\\"}', "{"]
    for text in texts:
        for cut in range(1, len(text)):
            assert scanned_in_two(text, cut) == value_end(text), (text, cut)
