"""An incremental SSE reader that keeps, for each event, when it arrived and when it was sent.

Arrival is the client clock when the bytes that completed the event came off the socket;
the send time is the server's `: zerohop-sent <unix seconds>` comment (zerohop.api.send_times)
that precedes the event's write, when the server stamps its writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STAMP_COMMENT = b": zerohop-sent "


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
    _pending: bytes = b""
    _sent: float | None = None
    _name: str | None = None
    _data: list[str] = field(default_factory=list)

    def feed(self, chunk: bytes, received: float) -> list[SseEvent]:
        lines = (self._pending + chunk).split(b"\n")
        self._pending = lines.pop()
        events = []
        for raw in lines:
            event = self._line(raw.removesuffix(b"\r"), received)
            if event is not None:
                events.append(event)
        return events

    def _line(self, line: bytes, received: float) -> SseEvent | None:
        if not line:
            return self._dispatch(received)
        if line.startswith(b":"):
            self._comment(line)
            return None
        key, _, value = line.partition(b":")
        text = value.removeprefix(b" ").decode("utf-8", "replace")
        if key == b"data":
            self._data.append(text)
        elif key == b"event":
            self._name = text
        return None

    def _comment(self, line: bytes) -> None:
        if not line.startswith(STAMP_COMMENT):
            return
        try:
            self._sent = float(line.removeprefix(STAMP_COMMENT))
        except ValueError:
            return
        self.stamps_seen += 1

    def _dispatch(self, received: float) -> SseEvent | None:
        if not self._data and self._name is None:
            return None
        event = SseEvent(received, self._sent, self._name, "\n".join(self._data))
        self._name, self._data = None, []
        return event
