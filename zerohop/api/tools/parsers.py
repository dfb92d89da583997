"""The tool-call formats read from a model's output, and which one a model writes: named
by `zerohop serve --tool-call-parser` (vLLM's names), or else told from its chat template.

Every parser takes the tools offered (a ToolSet: their arguments are validated too; or a
set of names) and reads output incrementally: `feed`
returns the text and whole calls told apart so far, `finish` what is left (as text)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Protocol

from zerohop.api.tools.forced import OPEN
from zerohop.api.tools.hermes import HermesParser, Parsed
from zerohop.api.tools.llama3 import PYTHON_TAG, Llama3JsonParser
from zerohop.api.tools.mistral import TOOL_CALLS, MistralParser
from zerohop.api.tools.prompt import template_takes_tools


class ToolParser(Protocol):
    def feed(self, text: str) -> Parsed: ...

    def finish(self) -> Parsed: ...


ParserFactory = Callable[[Collection[str]], ToolParser]

PARSERS: dict[str, ParserFactory] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}
PARSER_CHOICES = ("auto", *PARSERS)


def parser_for(template: str | None, name: str | None) -> ParserFactory:
    """The parser `name` (not None or "auto"), else the one the chat template's format
    suggests. A template that does not take tools gets the Hermes fallback prompt (prompt.py),
    so its output is read as Hermes."""
    if name not in (None, "auto"):
        if name not in PARSERS:
            raise ValueError(f"unknown tool-call parser {name!r}; one of {PARSER_CHOICES}")
        return PARSERS[name]
    if not template or not template_takes_tools(template) or OPEN in template:
        return HermesParser
    if TOOL_CALLS in template:
        return MistralParser
    if PYTHON_TAG in template or "ipython" in template:
        return Llama3JsonParser
    return HermesParser


def parse_whole(text: str, parser: ToolParser) -> Parsed:
    """All of an output at once."""
    parsed = parser.feed(text)
    rest = parser.finish()
    return Parsed(parsed.text + rest.text, parsed.calls + rest.calls)
