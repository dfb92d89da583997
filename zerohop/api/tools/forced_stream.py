"""A forced call read as it is decoded (forced.py's grammar: exactly one Hermes call).

The grammar guarantees the call is valid, so nothing waits for the whole of it: `feed`
reports the tool's name (`Parsed.opened`) as soon as it is read, then each new piece of the
arguments' JSON text as it comes (`Parsed.fragment`; joined, they are exactly the
arguments object, from its `{` to its matching `}`), then the whole call in `Parsed.calls`
once the arguments end. What follows them is the grammar's closing syntax, not output.

Output that does not begin the way the grammar writes a call (which it cannot, unless the
grammar changes) is read by the Hermes parser instead, whole calls only. A call cut short
(max_tokens) after its name was given out is dropped: a stream has sent its start and
fragments already, and it is no valid call.
"""

from __future__ import annotations

import re
from collections.abc import Collection

from zerohop.api.tools.forced import OPEN
from zerohop.api.tools.hermes import HermesParser, Parsed
from zerohop.api.tools.jsonscan import INCOMPLETE, INVALID, ValueScanner, loads
from zerohop.api.tools.spec import ToolCall

# The call's start up to its arguments, in two steps (the name is given out as soon as it
# is read): literals with any whitespace between, and the name.
_NAME = None
_TO_NAME = (OPEN, "{", '"name"', ":", _NAME)
_TO_ARGUMENTS = (",", '"arguments"', ":", "{")
_NAME_STRING = re.compile(r'"[A-Za-z0-9_-]*')
_BLANK = re.compile(r"\s*")


class ForcedCallParser:
    def __init__(self, tool_names: Collection[str]) -> None:
        self.tool_names = tool_names
        self._buffer = ""  # text not read yet
        self._name: str | None = None  # the tool, once the call's name was read
        self._arguments = ""  # the arguments' text so far
        self._scanner = ValueScanner()
        self._in_arguments = False  # the arguments' `{` was read
        self._done = False  # the arguments ended: what follows is the grammar's closing
        self._fallback: HermesParser | None = None  # the output is not laid out as expected

    def feed(self, text: str) -> Parsed:
        if self._fallback is not None:
            return self._fallback.feed(text)
        out = Parsed()
        if self._done:
            return out
        self._buffer += text
        if self._name is None and not self._read_name(out):
            return out
        if not self._in_arguments and not self._read_to_arguments():
            return out
        self._read_arguments(out)
        return out

    def finish(self) -> Parsed:
        """What is left: text when no call was begun, else nothing (see the module doc)."""
        if self._fallback is not None:
            return self._fallback.finish()
        rest = self._buffer if self._name is None else ""
        self._buffer, self._done = "", True
        return Parsed(text=rest)

    def _read_name(self, out: Parsed) -> bool:
        """Read the call's name; False while it is not known yet (or never will be)."""
        end, name = read_tokens(self._buffer, _TO_NAME)
        if end == INCOMPLETE:
            return False
        if end == INVALID or name not in self.tool_names:
            self._fallback = HermesParser(self.tool_names)
            parsed = self._fallback.feed(self._buffer)
            out.text, out.calls, self._buffer = parsed.text, parsed.calls, ""
            return False
        self._name = out.opened = name
        self._buffer = self._buffer[end:]
        return True

    def _read_to_arguments(self) -> bool:
        """Read up to the arguments' `{`; False while it is not there yet (or never will
        be: then the call is dropped)."""
        end, _ = read_tokens(self._buffer, _TO_ARGUMENTS)
        if end == INCOMPLETE:
            return False
        if end == INVALID:
            self._done, self._buffer = True, ""
            return False
        self._in_arguments, self._buffer = True, self._buffer[end - 1 :]
        return True

    def _read_arguments(self, out: Parsed) -> None:
        end = self._scanner.feed(self._buffer)
        piece = self._buffer if end == INCOMPLETE else self._buffer[: max(end, 0)]
        self._arguments += piece
        out.fragment, self._buffer = piece, ""
        if end == INCOMPLETE:
            return
        self._done = True
        arguments = loads(self._arguments) if end != INVALID else None
        if isinstance(arguments, dict) and self._name is not None:
            out.calls.append(ToolCall(self._name, arguments))


def read_tokens(text: str, tokens: tuple[str | None, ...]) -> tuple[int, str | None]:
    """(the index past `tokens` at the start of `text`, the name read for `_NAME`), with
    any whitespace before each; (INCOMPLETE, None) while `text` may still begin them,
    (INVALID, None) once it cannot."""
    pos, name = 0, None
    for token in tokens:
        pos = _skip_blank(text, pos)
        if token is _NAME:
            pos, name = _name_at(text, pos)
        else:
            seen = text[pos : pos + len(token)]
            pos = INVALID if not token.startswith(seen) else pos + len(token)
            pos = INCOMPLETE if pos > len(text) else pos
        if pos < 0:
            return pos, None
    return pos, name


def _name_at(text: str, pos: int) -> tuple[int, str | None]:
    """(the index past the JSON string of a tool's name at `pos`, the name)."""
    match = _NAME_STRING.match(text, pos)
    if match is None:
        return (INCOMPLETE if pos == len(text) else INVALID), None
    end = match.end()
    if end == len(text):
        return INCOMPLETE, None
    return (end + 1, text[pos + 1 : end]) if text[end] == '"' else (INVALID, None)


def _skip_blank(text: str, pos: int) -> int:
    return _BLANK.match(text, pos).end()  # type: ignore[union-attr]
