"""Server-sent events: the one parser every reader of an SSE stream uses.

`Parser.feed(chunk)` takes the bytes of a response as they arrive and returns the events
that chunk completed (an event ends at a blank line), so a caller that times events stamps
them at the feed that returned them. Lines end in `\\n`, `\\r\\n` or `\\r`. An event is every
blank-line-terminated block, comment-only ones included (a proxy forwarding the stream keeps
them; `data is None` tells them apart):

  name      the `event:` field (bytes), None when the block has none;
  data      the `data:` lines joined with `\\n` (one leading space of each dropped), None
            when the block has no data line;
  comments  the comment lines (`: ...`, the colon and one space dropped), in order;
  raw       the block as received, without the blank line that ends it.

Fields other than `event` and `data` (`id`, `retry`) are kept only in `raw`. Bytes after
the last blank line are not an event (a stream cut short). `events` and `aevents` parse
a whole (sync or async) stream of chunks.

A leaf package: it imports nothing of zerohop and nothing outside the standard library, so
clients, benchmarks and tests can use it without loading the server. The hot path (one
`data:` line per event, as zerohop frames tokens) is one split per chunk and one slice
per event.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import NamedTuple

__all__ = ["Event", "Parser", "aevents", "events", "parse"]


class Event(NamedTuple):
    name: bytes | None
    data: bytes | None
    comments: tuple[bytes, ...]
    raw: bytes


_new = tuple.__new__  # Event(...) without NamedTuple's keyword-handling __new__


class Parser:
    """Feed it byte chunks as they arrive; each feed returns the events it completed."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> list[Event]:
        buffer = self._pending + chunk if self._pending else chunk
        tail = b""
        if 13 in buffer:  # b"\r" (an int is searched with memchr, a bytes needle is not)
            if buffer.endswith(b"\r"):  # maybe the first half of a \r\n: wait for the next
                buffer, tail = buffer[:-1], b"\r"
            buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        blocks = buffer.split(b"\n\n")
        self._pending = blocks.pop() + tail if tail else blocks.pop()
        events = []
        for block in blocks:
            if block.startswith(b"data:") and 10 not in block:  # one data line (no b"\n")
                data = block[6:] if block[5:6] == b" " else block[5:]
                events.append(_new(Event, (None, data, (), block)))
            elif block.startswith(b"event:"):  # `event: NAME`, then maybe one data line
                head, _, rest = block.partition(b"\n")
                if rest.startswith(b"data:") and 10 not in rest:
                    name = head[7:] if head[6:7] == b" " else head[6:]
                    data = rest[6:] if rest[5:6] == b" " else rest[5:]
                    events.append(_new(Event, (name, data, (), block)))
                else:
                    events.append(_block(block))
            else:
                events.append(_block(block))
        return events


def _block(block: bytes) -> Event:
    name: bytes | None = None
    data: list[bytes] = []
    comments: list[bytes] = []
    for line in block.split(b"\n"):
        if not line:
            continue  # blank lines before the block's first field
        key, colon, value = line.partition(b":")
        if value[:1] == b" ":
            value = value[1:]
        if not key and colon:
            comments.append(value)
        elif key == b"data":
            data.append(value)
        elif key == b"event":
            name = value
    joined = b"\n".join(data) if data else None
    return _new(Event, (name, joined, tuple(comments), block))


def parse(body: bytes) -> list[Event]:
    """The events of a whole response body."""
    return Parser().feed(body)


def events(chunks: Iterable[bytes]) -> Iterator[Event]:
    """The events of a stream of byte chunks, each as soon as its chunk came."""
    parser = Parser()
    for chunk in chunks:
        yield from parser.feed(chunk)


async def aevents(chunks: AsyncIterable[bytes]) -> AsyncIterator[Event]:
    """`events` for an async stream of byte chunks."""
    parser = Parser()
    async for chunk in chunks:
        for event in parser.feed(chunk):
            yield event
