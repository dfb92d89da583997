"""Incremental detokenization with stop strings, one instance per request.

Text is decoded over a short window of recent tokens (vLLM's prefix/read offsets): the window
starts where the previous chunk started, so decoders that depend on context (a SentencePiece
leading space) see the same context as a full decode. A chunk is emitted only once it no
longer ends in U+FFFD, so a multi-byte character split over byte-level tokens is held until
complete. Each token costs one or two decodes of a few tokens, never of the whole output.

Text that could be the start of a stop string is held back until it can no longer match; a
match ends the output right before the stop string (vLLM's default) and nothing after it is
emitted.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from zerohop.engine.text.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of token ids into text chunks that are safe to send to a client."""

    __slots__ = (
        "_decode",
        "_done",
        "_held",
        "_ids",
        "_prefix_text",
        "_read",
        "_stops",
        "_text",
        "stop_reason",
    )

    def __init__(
        self, tokenizer: Tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True
    ) -> None:
        backend = tokenizer.backend
        self._decode = lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
        self._stops = [s for s in dict.fromkeys(stop) if s]
        self._ids: list[int] = []  # the window: tokens from the start of the last emitted chunk
        self._read = 0  # tokens of the window already turned into text
        self._prefix_text = ""  # decode(self._ids[: self._read])
        self._held = ""  # decoded text held back as a possible stop-string start
        self._text: list[str] = []
        self._done = False
        self.stop_reason: str | None = None

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._text) > 1:
            self._text[:] = ["".join(self._text)]
        return self._text[0] if self._text else ""

    @property
    def finished(self) -> bool:
        """True once a stop string matched; later tokens are ignored."""
        return self.stop_reason is not None

    def push(self, token_id: int) -> tuple[str, str | None]:
        """Add one token; return (text safe to emit now, matched stop string or None)."""
        if self._done:
            return "", None
        self._ids.append(token_id)
        window_text = self._decode(self._ids)
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(_REPLACEMENT):
            return "", None  # nothing new, or a character still incomplete
        new_text = window_text[len(self._prefix_text) :]
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return self._emit(new_text, final=False)

    def replay(self, token_ids: Sequence[int]) -> None:
        """Take tokens whose text was already sent (by another replica, before a failover):
        afterwards the next token's text continues exactly where that text stopped."""
        for token_id in token_ids:
            self.push(token_id)

    def fork(self) -> IncrementalDetokenizer:
        """An independent copy in this state: another choice continuing the same prompt."""
        other = copy.copy(self)
        other._ids, other._text = list(self._ids), list(self._text)
        return other

    def flush(self) -> str:
        """End of the request: the text still held back (an incomplete character decodes
        as U+FFFD, as in a full decode). Empty after a stop string matched."""
        if self._done:
            return ""
        tail = self._decode(self._ids)[len(self._prefix_text) :]
        text, _ = self._emit(tail, final=True)
        self._done = True
        return text

    def _emit(self, new_text: str, final: bool) -> tuple[str, str | None]:
        buffer = self._held + new_text
        match = self._find_stop(buffer)
        if match is not None:
            index, stop = match
            self._done = True
            self.stop_reason = stop
            self._held = ""
            return self._record(buffer[:index]), stop
        keep = 0 if final else self._partial_stop_length(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return self._record(buffer[: len(buffer) - keep]), None

    def _record(self, text: str) -> str:
        if text:
            self._text.append(text)
        return text

    def _find_stop(self, buffer: str) -> tuple[int, str] | None:
        """The earliest stop string in `buffer` (the first listed wins a tie)."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = buffer.find(stop)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _partial_stop_length(self, buffer: str) -> int:
        """Length of the longest end of `buffer` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:length]):
                    longest = length
                    break
        return longest
