"""The Llama 3.x JSON tool-call format: a call is a JSON object `{"name": ...,
"parameters": {...}}` (or "arguments"), optionally after `<|python_tag|>`; several calls are
separated by `;`.

A call may begin at the start of the output, at the start of a line, right after
`<|python_tag|>` or after `;` following a call. Text streams at once, except what could
still begin a call (an object at such a place, a partial tag), held back until it is
decided. An object that is not a valid call of a known tool is given back as text.
"""

from __future__ import annotations

from zerohop.api.tools.hermes import Parsed, call_from
from zerohop.api.tools.jsonscan import INCOMPLETE, loads, partial_tag, value_end
from zerohop.api.tools.stepped import SteppedParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(SteppedParser):
    def _reset(self) -> None:
        self._boundary = True  # only blank text since a place a call may begin
        self._between = True  # blanks here are dropped when a call follows
        self._after_call = False  # a call came last: one `;` may join the next

    def _step(self, out: Parsed, final: bool) -> bool:
        if not self._boundary:
            return self._text(out, final)
        rest = self._buffer.lstrip()
        blank = self._buffer[: len(self._buffer) - len(rest)]
        if not rest:
            return self._blank(out, blank, final)
        if rest.startswith(PYTHON_TAG):
            self._buffer, self._between, self._after_call = rest[len(PYTHON_TAG) :], True, False
            return True
        if self._after_call and rest[0] == ";":
            self._buffer, self._after_call = rest[1:], False
            return True
        if rest[0] == "{":
            return self._object(out, blank, rest, final)
        if PYTHON_TAG.startswith(rest) and not final:
            return False
        self._to_text(out, blank, rest)
        return True

    def _blank(self, out: Parsed, blank: str, final: bool) -> bool:
        if self._between and not final:
            return False  # dropped when a call follows
        out.text += blank
        self._buffer = ""
        return False

    def _object(self, out: Parsed, blank: str, rest: str, final: bool) -> bool:
        end = value_end(rest)
        if end == INCOMPLETE and not final and _may_be_call(rest):
            return False
        call = call_from(loads(rest[:end]), self.tool_names) if end > 0 else None
        if call is None:
            self._to_text(out, blank, rest)
            return True
        out.text += "" if self._between else blank
        out.calls.append(call)
        self._buffer, self._between, self._after_call = rest[end:], True, True
        return True

    def _to_text(self, out: Parsed, blank: str, rest: str) -> None:
        out.text += blank
        self._buffer, self._boundary, self._between, self._after_call = rest, False, False, False

    def _text(self, out: Parsed, final: bool) -> bool:
        line = self._buffer.find("\n")
        tag = self._buffer.find(PYTHON_TAG)
        if tag >= 0 and (line < 0 or tag < line):
            out.text += self._buffer[:tag]
            self._buffer, self._boundary = self._buffer[tag:], True
            return True
        if line >= 0:
            out.text += self._buffer[: line + 1]
            self._buffer, self._boundary = self._buffer[line + 1 :], True
            return True
        keep = 0 if final else partial_tag(self._buffer, PYTHON_TAG)
        out.text += self._buffer[: len(self._buffer) - keep]
        self._buffer = self._buffer[len(self._buffer) - keep :]
        return False


def _may_be_call(text: str) -> bool:
    """Whether an unfinished object could still be a call: its first key has begun."""
    inner = text[1:].lstrip()
    return not inner or inner[0] == '"'
