"""Mistral's tool-call format: `[TOOL_CALLS]` followed by a JSON list of calls
`[{"name": ..., "arguments": {...}}, ...]` (a single object is taken too).

Text streams at once, except a possible start of the tag, held back until it is decided.
A list that does not parse, or holds anything but valid calls of known tools, is given back
as text (with its tag). The v11+ tokenizers' `[TOOL_CALLS]name[ARGS]{...}` is not read.
"""

from __future__ import annotations

from typing import Any

from zerohop.api.tools.hermes import Parsed, call_from
from zerohop.api.tools.jsonscan import INCOMPLETE, loads, partial_tag, value_end
from zerohop.api.tools.spec import ToolCall
from zerohop.api.tools.stepped import SteppedParser

TOOL_CALLS = "[TOOL_CALLS]"


class MistralParser(SteppedParser):
    def _reset(self) -> None:
        self._in_calls = False  # the tag was read: its list comes next

    def _held(self) -> str:
        return TOOL_CALLS if self._in_calls else ""

    def _step(self, out: Parsed, final: bool) -> bool:
        if self._in_calls:
            return self._calls(out, final)
        start = self._buffer.find(TOOL_CALLS)
        if start >= 0:
            out.text += self._buffer[:start]
            self._buffer, self._in_calls = self._buffer[start + len(TOOL_CALLS) :], True
            return True
        keep = 0 if final else partial_tag(self._buffer, TOOL_CALLS)
        out.text += self._buffer[: len(self._buffer) - keep]
        self._buffer = self._buffer[len(self._buffer) - keep :]
        return False

    def _calls(self, out: Parsed, final: bool) -> bool:
        rest = self._buffer.lstrip()
        if not rest:
            return False
        end = value_end(rest)
        if end == INCOMPLETE and not final:
            return False
        calls = self._parsed(rest[:end]) if end > 0 else None
        self._in_calls = False
        if calls is None:
            out.text += TOOL_CALLS
            return True  # the buffer is text again
        out.calls += calls
        self._buffer = rest[end:]
        return True

    def _parsed(self, body: str) -> list[ToolCall] | None:
        value: Any = loads(body)
        items = value if isinstance(value, list) else [value]
        calls = [call_from(item, self.tool_names) for item in items]
        if not calls or any(c is None for c in calls):
            return None
        return calls  # type: ignore[return-value]
