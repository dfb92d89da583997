"""The Llama 3.x JSON and Mistral tool-call parsers and the choice of parser: any split of
an output into pieces reads as the whole output does; what is not a valid call is text,
in every format also a call whose arguments its tool's schema refuses."""

from __future__ import annotations

import random
from typing import Any

import pytest

from zerohop.api.tools.forced_stream import ForcedCallParser
from zerohop.api.tools.hermes import HermesParser
from zerohop.api.tools.llama3 import Llama3JsonParser
from zerohop.api.tools.mistral import MistralParser
from zerohop.api.tools.parsers import PARSER_CHOICES, parse_whole, parser_for
from zerohop.api.tools.spec import Tool, ToolSet

NAMES = {"get_weather", "add"}
WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
ADD = '{"name": "add", "arguments": {"a": 1, "b": "}{\\""}}'


def read(factory, pieces: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    parser = factory(NAMES)
    text, calls = "", []
    for piece in [*pieces, None]:
        parsed = parser.feed(piece) if piece is not None else parser.finish()
        text += parsed.text
        calls += [(c.name, c.arguments) for c in parsed.calls]
    return text, calls


def splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def same_in_any_split(factory, text: str) -> tuple[str, list[tuple[str, dict]]]:
    whole = read(factory, [text])
    if len(text) < 2:
        return whole
    rng = random.Random(text)
    for _ in range(200):
        assert read(factory, splits(text, rng)) == whole
    assert read(factory, list(text)) == whole
    return whole


WEATHER_CALL = ("get_weather", {"city": "Paris"})
ADD_CALL = ("add", {"a": 1, "b": '}{"'})

LLAMA_CASES = [
    (WEATHER, "", [WEATHER_CALL]),
    ("<|python_tag|>" + WEATHER, "", [WEATHER_CALL]),
    (f"{WEATHER}; {ADD}", "", [WEATHER_CALL, ADD_CALL]),
    (f"<|python_tag|>{WEATHER};<|python_tag|>{ADD}\n", "\n", [WEATHER_CALL, ADD_CALL]),
    (f"Let me look.\n{WEATHER}", "Let me look.\n", [WEATHER_CALL]),
    (f"Sure. <|python_tag|>{WEATHER}", "Sure. ", [WEATHER_CALL]),
    ("a {b} c\n{not json}\n", "a {b} c\n{not json}\n", []),
    ('{"name": "unknown", "parameters": {}}', '{"name": "unknown", "parameters": {}}', []),
    ('{"name": "add", "parameters": [1]}', '{"name": "add", "parameters": [1]}', []),
    ('{"name": "add", "param', '{"name": "add", "param', []),
    (f"{WEATHER} and then", " and then", [WEATHER_CALL]),
    ("<|python_ta", "<|python_ta", []),
    ("x <|pyth", "x <|pyth", []),
    ("", "", []),
]


@pytest.mark.parametrize(("output", "text", "calls"), LLAMA_CASES)
def test_llama3_json_reads_the_same_in_any_split(output, text, calls):
    assert same_in_any_split(Llama3JsonParser, output) == (text, calls)


MISTRAL_CASES = [
    (f"[TOOL_CALLS][{WEATHER}]", "", [WEATHER_CALL]),
    (f"[TOOL_CALLS] [{WEATHER}, {ADD}]", "", [WEATHER_CALL, ADD_CALL]),
    (f"Checking.[TOOL_CALLS]{ADD} done", "Checking. done", [ADD_CALL]),
    (f"[TOOL_CALLS][{WEATHER}, 3]", f"[TOOL_CALLS][{WEATHER}, 3]", []),
    ("[TOOL_CALLS] not a list", "[TOOL_CALLS] not a list", []),
    ("[TOOL_CALLS][{]", "[TOOL_CALLS][{]", []),
    (f"[TOOL_CALLS][{WEATHER}", f"[TOOL_CALLS][{WEATHER}", []),
    ("[TOOL_CALLS]", "[TOOL_CALLS]", []),
    ("plain [TOOL_CA", "plain [TOOL_CA", []),
    ("[1, 2] is a list", "[1, 2] is a list", []),
]


@pytest.mark.parametrize(("output", "text", "calls"), MISTRAL_CASES)
def test_mistral_reads_the_same_in_any_split(output, text, calls):
    assert same_in_any_split(MistralParser, output) == (text, calls)


def test_text_before_a_call_streams_before_the_call_is_whole():
    llama = Llama3JsonParser(NAMES)
    assert llama.feed("Let me look.\n").text == "Let me look.\n"
    assert llama.feed(WEATHER[:10]).text == ""
    assert [c.name for c in llama.feed(WEATHER[10:]).calls] == ["get_weather"]
    mistral = MistralParser(NAMES)
    assert mistral.feed("Checking. [TOOL_").text == "Checking. "
    assert mistral.feed(f"CALLS][{WEATHER}]").calls[0].arguments == {"city": "Paris"}


def test_an_unfinished_object_that_cannot_be_a_call_is_text_at_once():
    assert Llama3JsonParser(NAMES).feed("{ not a call").text == "{ not a call"


HERMES = "{% for t in tools %}<tool_call>{% endfor %}"
MISTRAL = "{% if tools %}[AVAILABLE_TOOLS]{{ tools }}{% endif %}[TOOL_CALLS]"
LLAMA = "{% if tools %}{{ tools }}{% endif %}<|start_header_id|>ipython<|end_header_id|>"


@pytest.mark.parametrize(
    ("template", "name", "expected"),
    [
        (None, None, HermesParser),
        ("{{ messages }}", "auto", HermesParser),
        (HERMES, None, HermesParser),
        (MISTRAL, None, MistralParser),
        (LLAMA, "auto", Llama3JsonParser),
        ("{{ tools }}<|python_tag|>", None, Llama3JsonParser),
        ("{{ tools }}", None, HermesParser),
        ("[TOOL_CALLS] and no tool list", None, HermesParser),
        (HERMES, "mistral", MistralParser),
        (None, "llama3_json", Llama3JsonParser),
        (MISTRAL, "hermes", HermesParser),
    ],
)
def test_parser_for_takes_the_name_or_else_the_template(template, name, expected):
    assert parser_for(template, name) is expected


def test_parser_for_refuses_an_unknown_name():
    with pytest.raises(ValueError, match="pythonic"):
        parser_for(None, "pythonic")


def test_parse_whole_joins_feed_and_finish():
    parsed = parse_whole(f"Hi\n{WEATHER}; {{", Llama3JsonParser(NAMES))
    assert parsed.text == "Hi\n {" and [c.name for c in parsed.calls] == ["get_weather"]


def test_the_cli_offers_every_parser():
    from zerohop.cli.arg_types import TOOL_CALL_PARSERS

    assert TOOL_CALL_PARSERS == PARSER_CHOICES


def test_a_forced_call_is_read_as_hermes_whatever_the_chosen_format():
    """As Hermes, as it is decoded (forced_stream.py)."""
    import msgspec

    from zerohop.api.conversation.planner import call_parser
    from zerohop.api.openai.schema import ChatRequest
    from zerohop.api.openai.turns import conversation

    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "hi"}]

    def chat_request(messages: list, **fields: Any) -> ChatRequest:
        body = {"model": "m", "messages": messages, **fields}
        return msgspec.json.decode(msgspec.json.encode(body), type=ChatRequest)

    auto = chat_request(messages, tools=tools)
    forced = chat_request(messages, tools=tools, tool_choice="required")
    assert call_parser(conversation(auto, {}), MistralParser) is MistralParser
    assert call_parser(conversation(forced, {}), MistralParser) is ForcedCallParser


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
CHECKED = ToolSet([Tool("get_weather", parameters=SCHEMA)])
VALID_ARGS = '{"city": "Oslo", "days": 2}'
INVALID_ARGS = {"wrong type": '{"city": 3}', "missing required": '{"days": 2}'}
FORMATS = {
    "hermes": (HermesParser, '<tool_call>{{"name": "get_weather", "arguments": {}}}</tool_call>'),
    "llama3_json": (Llama3JsonParser, '{{"name": "get_weather", "parameters": {}}}'),
    "mistral": (MistralParser, '[TOOL_CALLS][{{"name": "get_weather", "arguments": {}}}]'),
}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_call_whose_arguments_follow_the_schema_is_a_call(fmt: str) -> None:
    factory, shape = FORMATS[fmt]
    parsed = parse_whole("Hi\n" + shape.format(VALID_ARGS), factory(CHECKED))
    assert parsed.text == "Hi\n" and [(c.name, c.arguments) for c in parsed.calls] == [
        ("get_weather", {"city": "Oslo", "days": 2})
    ]


@pytest.mark.parametrize("case", list(INVALID_ARGS))
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_call_the_schema_refuses_is_the_text_the_model_wrote(fmt: str, case: str) -> None:
    factory, shape = FORMATS[fmt]
    output = "Hi\n" + shape.format(INVALID_ARGS[case])
    parsed = parse_whole(output, factory(CHECKED))
    assert parsed.calls == [] and parsed.text == output
    assert [c.name for c in parse_whole(output, factory({"get_weather"})).calls] == [
        "get_weather"
    ]  # a set of names checks no schema


def test_an_unresolvable_ref_validates_nothing() -> None:
    remote = {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}
    tools = ToolSet([Tool("f", parameters=remote)])
    assert not tools.valid("f", {"a": 1}) and tools.valid("f", {})
