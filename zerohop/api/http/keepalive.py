"""Keep a quiet stream alive: a marker each time its source has been silent a while.

A stream starts (headers, `message_start` or the first chunk) as soon as the request is
admitted; then a long prefill (a 20-30k-token prompt on a CPU replica takes many seconds), a
queue wait, or output held back while a tool call is read sends nothing. Agent harnesses and
proxies time out idle streams, so the surfaces write a keep-alive whenever nothing has been
written for `interval` seconds: Anthropic's `event: ping`, an SSE comment (`: ping`) on the
OpenAI API, whose clients skip comments.

Decision: 5 seconds by default (`--stream-ping-interval`). The Anthropic API documents only
that a stream "may include any number of ping events"; 5 s is well under the first-byte and
idle timeouts of agent harnesses (tens of seconds) and proxies (nginx and cloud load
balancers: 60 s), and costs a few dozen bytes per silent interval.

OpenAI Chat and Completions streams wait 30 s (`--openai-ping-interval`): the OpenAI API and
vLLM never write a comment there, and a client that strips each read before splitting events
(vLLM's own `bench serve`, 0.32) joins a comment that arrives alone to every event after it and
reads the rest of the stream as one chunk at its end. 30 s still beats the 60 s idle timeouts;
the chat stream's role chunk, sent at admission, meets first-byte timeouts.

The wait never cancels the source's pending step: the next delta is awaited in a task that
outlives each interval, so a ping never aborts the request (cancelling an engine generator's
`anext` would).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Generic, TypeVar

DEFAULT_PING_INTERVAL = 5.0  # seconds
DEFAULT_OPENAI_PING_INTERVAL = 30.0  # seconds: OpenAI Chat and Completions streams

T = TypeVar("T")


class Pings(Generic[T]):
    """`source`'s items, and None whenever nothing was written for `interval` seconds (a
    ping is due; the reader writes it). The reader calls `wrote()` after each write: steps
    that write nothing (a prefill chunk, held-back output) do not count as activity.

    Iterate with `async with contextlib.aclosing(pings.items())`: closing it cancels the
    pending wait, which ends the source (an engine request is aborted)."""

    def __init__(self, source: AsyncIterator[T], interval: float) -> None:
        self.source, self.interval = source, interval
        self.written = time.monotonic()

    def wrote(self) -> None:
        self.written = time.monotonic()

    async def items(self) -> AsyncGenerator[T | None, None]:
        pending: asyncio.Future[T] | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(anext(self.source))
                left = self.written + self.interval - time.monotonic()
                if left <= 0:
                    self.wrote()
                    yield None
                    continue
                done, _ = await asyncio.wait({pending}, timeout=left)
                if not done:
                    continue
                finished, pending = pending, None
                try:
                    item = finished.result()
                except StopAsyncIteration:
                    return
                yield item
        finally:
            if pending is not None:
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
