"""SSE framing of OpenAI streams.

Each content chunk is a per-request pre-encoded prefix + `orjson.dumps(text)` + suffix: one
chunk per engine step (one token, normally), written the moment it arrives.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from zerohop.api.openai.output import Choices, LogprobFormatter, legacy_columns
from zerohop.engine.base.outputs import RequestDelta

DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"  # an SSE comment: keeps a silent stream alive, clients skip it


def sse(body: Any) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


class Stream:
    """Pre-encoded SSE framing for one streamed request; subclasses fill in the choice.

    With `n` > 1 choices the chunks interleave them as the engine's deltas come (each chunk
    names its choice's index), each choice opens and finishes with its own chunk, and the
    usage chunk comes once every choice has finished (`done`)."""

    object_name = b""
    suffix = b""  # after a chunk's text when it carries nothing else (set per request)
    text_close: bytes  # closes the text's object before logprobs

    def __init__(
        self, rid: str, model: str, include_usage: bool, prompt_tokens: int, n: int = 1
    ) -> None:
        self.head = (
            b'data: {"id":"' + rid.encode() + b'","object":"' + self.object_name
            + b'","created":' + str(int(time.time())).encode()
            + b',"model":' + orjson.dumps(model) + b',"choices":['
        )  # fmt: skip
        self.tail = (b',"usage":null' if include_usage else b"") + b"}\n\n"
        self.include_usage = include_usage
        self.choices = Choices(prompt_tokens, n)
        self.token_ids = False  # vLLM's `return_token_ids`: each choice carries its tokens
        # Each choice's chunk up to its text: the head and `{"index":i,...`.
        self.prefixes = [self.choice_head(i) for i in range(n)]

    @property
    def done(self) -> bool:
        """Every choice has finished."""
        return self.choices.done

    def choice_head(self, index: int) -> bytes:
        raise NotImplementedError

    def opening(self) -> bytes:
        return b"".join(self.open_choice(i) for i in range(self.choices.n))

    def open_choice(self, index: int) -> bytes:
        return b""

    def step(self, formatter: LogprobFormatter, delta: RequestDelta) -> bytes:
        """One chunk per token, even one whose text is still held back; then the choice's
        finish chunk when this delta is its last."""
        totals = self.choices.add(delta)
        data = self.content(formatter, delta) if delta.new_token_ids else b""
        if delta.finished:
            stop_reason = orjson.dumps(totals.stop_reason)
            data += self.head + self.finish_choice(delta.index, totals.finish_reason, stop_reason)
            data += b"]" + self.tail
        return data

    def content(self, formatter: LogprobFormatter, delta: RequestDelta) -> bytes:
        prefix, text = self.prefixes[delta.index], orjson.dumps(delta.new_text)
        logprobs = self.logprobs(formatter, delta) if delta.new_logprobs is not None else None
        if logprobs is None and not self.token_ids:
            return prefix + text + self.suffix
        ids = b',"token_ids":' + orjson.dumps(delta.new_token_ids) if self.token_ids else b""
        return (
            prefix + text + self.text_close + b',"logprobs":' + (logprobs or b"null")
            + b',"finish_reason":null' + ids + b"}]" + self.tail
        )  # fmt: skip

    def logprobs(self, formatter: LogprobFormatter, delta: RequestDelta) -> bytes | None:
        """The chunk's encoded logprobs, or None when the request asked for none."""
        raise NotImplementedError

    def closing(self) -> bytes:
        """After every choice's finish chunk: the usage chunk, when asked for."""
        if not self.include_usage:
            return b""
        return self.head + b'],"usage":' + orjson.dumps(self.choices.usage()) + b"}\n\n"

    def finish_choice(self, index: int, reason: str | None, stop_reason: bytes) -> bytes:
        raise NotImplementedError


def _index(index: int) -> bytes:
    return b'{"index":' + str(index).encode()


class ChatStream(Stream):
    object_name = b"chat.completion.chunk"
    text_close = b"}"

    def __init__(
        self,
        rid: str,
        model: str,
        include_usage: bool,
        prompt_tokens: int,
        top: int | None,
        n: int = 1,
    ) -> None:
        super().__init__(rid, model, include_usage, prompt_tokens, n)
        self.top = top
        self.suffix = b'},"logprobs":null,"finish_reason":null}]' + self.tail

    def choice_head(self, index: int) -> bytes:
        return self.head + _index(index) + b',"delta":{"content":'

    def open_choice(self, index: int) -> bytes:
        delta = _index(index) + b',"delta":{"role":"assistant","content":""},'
        return self.head + delta + b'"logprobs":null,"finish_reason":null}]' + self.tail

    def logprobs(self, formatter: LogprobFormatter, delta: RequestDelta) -> bytes | None:
        if self.top is None:
            return None
        return orjson.dumps({"content": formatter.chat(delta, self.top)})

    def finish_choice(self, index: int, reason: str | None, stop_reason: bytes) -> bytes:
        return (
            _index(index) + b',"delta":{},"logprobs":null,"finish_reason":'
            + orjson.dumps(reason) + b',"stop_reason":' + stop_reason + b"}"
        )  # fmt: skip


class CompletionStream(Stream):
    object_name = b"text_completion"
    text_close = b""

    def __init__(
        self,
        rid: str,
        model: str,
        include_usage: bool,
        prompt_tokens: int,
        echo: str,
        n: int = 1,
    ) -> None:
        super().__init__(rid, model, include_usage, prompt_tokens, n)
        self.echo = echo
        self.suffix = b',"logprobs":null,"finish_reason":null}]' + self.tail
        self.offsets = [0] * n  # each choice's text_offset so far

    def choice_head(self, index: int) -> bytes:
        return self.head + _index(index) + b',"text":'

    def open_choice(self, index: int) -> bytes:
        if not self.echo:
            return b""
        return self.prefixes[index] + orjson.dumps(self.echo) + self.suffix

    def logprobs(self, formatter: LogprobFormatter, delta: RequestDelta) -> bytes | None:
        # Each chunk carries its own tokens' logprobs; text_offset keeps counting.
        chunk = legacy_columns()
        self.offsets[delta.index] = formatter.legacy(delta, chunk, self.offsets[delta.index])
        return orjson.dumps(chunk)

    def finish_choice(self, index: int, reason: str | None, stop_reason: bytes) -> bytes:
        return (
            _index(index) + b',"text":"","logprobs":null,"finish_reason":'
            + orjson.dumps(reason) + b',"stop_reason":' + stop_reason + b"}"
        )  # fmt: skip
