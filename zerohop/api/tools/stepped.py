"""The loop the buffered parsers (Llama 3 JSON, Mistral) share: text is added to a buffer
and `_step` decides its start, a piece at a time, until it needs more text; at the end of
the output, what is still held is text."""

from __future__ import annotations

from collections.abc import Collection

from zerohop.api.tools.hermes import Parsed


class SteppedParser:
    def __init__(self, tool_names: Collection[str]) -> None:
        self.tool_names = tool_names
        self._buffer = ""
        self._reset()

    def feed(self, text: str) -> Parsed:
        self._buffer += text
        out = Parsed()
        while self._buffer and self._step(out, final=False):
            pass
        return out

    def finish(self) -> Parsed:
        out = Parsed()
        while self._buffer and self._step(out, final=True):
            pass
        out.text += self._held() + self._buffer
        self._buffer = ""
        self._reset()
        return out

    def _reset(self) -> None:
        """The state at the output's start."""

    def _held(self) -> str:
        """Text the parser's state holds beside the buffer (a tag it read), given back."""
        return ""

    def _step(self, out: Parsed, final: bool) -> bool:
        """Decide the buffer's start if it can be; False when more text is needed."""
        raise NotImplementedError
