"""SSE framing of OpenAI streams.

Each content chunk is a per-request pre-encoded prefix + `orjson.dumps(text)` + suffix: one
chunk per engine step (one token, normally), written the moment it arrives.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from zerohop.api.openai_output import LogprobFormatter, Totals, legacy_columns
from zerohop.engine.outputs import RequestDelta

DONE = b"data: [DONE]\n\n"


def sse(body: Any) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


class Stream:
    """Pre-encoded SSE framing for one streamed request; subclasses fill in the choice."""

    object_name = b""

    def __init__(self, rid: str, model: str, include_usage: bool, prompt_tokens: int) -> None:
        self.head = (
            b'data: {"id":"' + rid.encode() + b'","object":"' + self.object_name
            + b'","created":' + str(int(time.time())).encode()
            + b',"model":' + orjson.dumps(model) + b',"choices":['
        )  # fmt: skip
        self.tail = (b',"usage":null' if include_usage else b"") + b"}\n\n"
        self.include_usage = include_usage
        self.totals = Totals(prompt_tokens)
        self.token_ids = False  # vLLM's `return_token_ids`: each choice carries its tokens

    def opening(self) -> bytes:
        return b""

    def step(self, formatter: LogprobFormatter, delta: RequestDelta) -> bytes:
        """One chunk per token, even one whose text is still held back."""
        self.totals.add(delta)
        if not delta.new_token_ids:
            return b""
        text = orjson.dumps(delta.new_text)
        logprobs = self.logprobs(formatter, delta) if delta.new_logprobs is not None else None
        if logprobs is None and not self.token_ids:
            return self.prefix + text + self.suffix
        ids = b',"token_ids":' + orjson.dumps(delta.new_token_ids) if self.token_ids else b""
        return (
            self.prefix + text + self.text_close + b',"logprobs":' + (logprobs or b"null")
            + b',"finish_reason":null' + ids + b"}]" + self.tail
        )  # fmt: skip

    def logprobs(self, formatter: LogprobFormatter, delta: RequestDelta) -> bytes | None:
        """The chunk's encoded logprobs, or None when the request asked for none."""
        raise NotImplementedError

    def closing(self) -> bytes:
        totals = self.totals
        finish = self.finish_choice(totals.finish_reason, orjson.dumps(totals.stop_reason))
        data = self.head + finish + b"]" + self.tail
        if self.include_usage:
            data += self.head + b'],"usage":' + orjson.dumps(totals.usage()) + b"}\n\n"
        return data

    def finish_choice(self, reason: str | None, stop_reason: bytes) -> bytes:
        raise NotImplementedError


class ChatStream(Stream):
    object_name = b"chat.completion.chunk"

    def __init__(
        self, rid: str, model: str, include_usage: bool, prompt_tokens: int, top: int | None
    ) -> None:
        super().__init__(rid, model, include_usage, prompt_tokens)
        self.top = top
        self.prefix = self.head + b'{"index":0,"delta":{"content":'
        self.text_close = b"}"
        self.suffix = b'},"logprobs":null,"finish_reason":null}]' + self.tail

    def opening(self) -> bytes:
        delta = b'{"index":0,"delta":{"role":"assistant","content":""},'
        return self.head + delta + b'"logprobs":null,"finish_reason":null}]' + self.tail

    def logprobs(self, formatter: LogprobFormatter, delta: RequestDelta) -> bytes | None:
        if self.top is None:
            return None
        return orjson.dumps({"content": formatter.chat(delta, self.top)})

    def finish_choice(self, reason: str | None, stop_reason: bytes) -> bytes:
        return (
            b'{"index":0,"delta":{},"logprobs":null,"finish_reason":' + orjson.dumps(reason)
            + b',"stop_reason":' + stop_reason + b"}"
        )  # fmt: skip


class CompletionStream(Stream):
    object_name = b"text_completion"

    def __init__(
        self, rid: str, model: str, include_usage: bool, prompt_tokens: int, echo: str
    ) -> None:
        super().__init__(rid, model, include_usage, prompt_tokens)
        self.echo = echo
        self.prefix = self.head + b'{"index":0,"text":'
        self.text_close = b""
        self.suffix = b',"logprobs":null,"finish_reason":null}]' + self.tail
        self.offset = 0

    def opening(self) -> bytes:
        if not self.echo:
            return b""
        return self.prefix + orjson.dumps(self.echo) + self.suffix

    def logprobs(self, formatter: LogprobFormatter, delta: RequestDelta) -> bytes | None:
        # Each chunk carries its own tokens' logprobs; text_offset keeps counting.
        chunk = legacy_columns()
        self.offset = formatter.legacy(delta, chunk, self.offset)
        return orjson.dumps(chunk)

    def finish_choice(self, reason: str | None, stop_reason: bytes) -> bytes:
        return (
            b'{"index":0,"text":"","logprobs":null,"finish_reason":' + orjson.dumps(reason)
            + b',"stop_reason":' + stop_reason + b"}"
        )  # fmt: skip
