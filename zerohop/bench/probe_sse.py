"""The probe's view of an SSE stream: for each event, when it arrived and when it was sent.

Arrival is the client clock when the bytes that completed the event came off the socket
(the caller feeds each chunk with its arrival time; `zerohop.sse` parses); the send time is
the server's `: zerohop-sent <unix seconds>` comment (zerohop.api.http.send_times) that precedes
the event's write, when the server stamps its writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zerohop.sse import Parser

STAMP_COMMENT = b"zerohop-sent "  # the comment's text, after `: `


@dataclass(slots=True)
class SseEvent:
    received: float  # client wall clock, seconds
    sent: float | None  # server wall clock from the latest stamp, None without stamps
    name: str | None
    data: str


@dataclass(slots=True)
class SseReader:
    """Feed it byte chunks as they arrive; it returns the events each chunk completed."""

    stamps_seen: int = 0
    _parser: Parser = field(default_factory=Parser)
    _sent: float | None = None

    def feed(self, chunk: bytes, received: float) -> list[SseEvent]:
        events = []
        for event in self._parser.feed(chunk):
            for comment in event.comments:
                self._stamp(comment)
            if event.data is None and event.name is None:
                continue  # comments only (or fields the probe does not read)
            name = None if event.name is None else event.name.decode("utf-8", "replace")
            data = (event.data or b"").decode("utf-8", "replace")
            events.append(SseEvent(received, self._sent, name, data))
        return events

    def _stamp(self, comment: bytes) -> None:
        if not comment.startswith(STAMP_COMMENT):
            return
        try:
            self._sent = float(comment.removeprefix(STAMP_COMMENT))
        except ValueError:
            return
        self.stamps_seen += 1
