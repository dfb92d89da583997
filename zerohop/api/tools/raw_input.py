"""Tools whose input is raw text, not a JSON object (the Responses API's `custom` tools, such
as Codex's `apply_patch`), optionally in a grammar (Lark or a regex).

To the model such a tool is a function with one string argument, `input` (`as_function`):
that is how chat templates show tools, and how a model's past calls of it are rendered. A
call it writes in the tool-call format is read like any other and becomes the raw input of
`arguments["input"]`, once that input matches the tool's grammar (`ToolSet.valid`, through
`input_grammar.input_matches`: a call whose input does not match is text, as an invalid call is).

A forced call of such a tool (tool_choice `custom`) has no call syntax around it: the whole
output is the input, decoded by the tool's grammar, and read by `RawInputParser` piece by
piece as it is decoded.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from zerohop.api.tools.hermes import Parsed
from zerohop.api.tools.spec import ToolCall

INPUT = "input"


def input_parameters(description: str) -> dict[str, Any]:
    """The argument schema a raw-input tool is shown to the model with."""
    text = {"type": "string", "description": description}
    return {
        "type": "object",
        "properties": {INPUT: text},
        "required": [INPUT],
        "additionalProperties": False,
    }


class RawInputParser:
    """The whole output as one call of `name`: its name at once, then its input as decoded."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._input: list[str] = []
        self._opened = False

    def feed(self, text: str) -> Parsed:
        out = Parsed(fragment=text)
        if not self._opened:
            self._opened, out.opened = True, self.name
        self._input.append(text)
        return out

    def finish(self) -> Parsed:
        return Parsed(calls=[ToolCall(self.name, {INPUT: "".join(self._input)})])


def raw_input_parser(name: str) -> Callable[[Collection[str]], RawInputParser]:
    """A parser factory (tools/parsers.py's shape) reading the output as `name`'s input."""
    return lambda _tools: RawInputParser(name)
