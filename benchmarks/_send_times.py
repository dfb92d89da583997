"""The server's send time of each SSE write, as the benchmarks read it: the request header
`zerohop-send-times: 1` makes the server write an SSE comment `: zerohop-sent T` before each
write, and a tee in the SDK's HTTP transport reads them (same machine, same clock)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx2

SEND_TIMES_HEADER = "zerohop-send-times"
STAMP = b": zerohop-sent "


@dataclass
class SendTimes:
    """What one streamed response's tee saw: the server's stamp of the write holding the first
    content_block_delta, and this client's clock when that write arrived (Unix seconds)."""

    first_delta_sent: float | None = None
    first_delta_received: float | None = None
    message_start_sent: float | None = None
    message_delta_sent: float | None = None
    stamps: int = 0
    _last: float | None = None
    _tail: bytes = b""

    def feed(self, chunk: bytes) -> None:
        lines = (self._tail + chunk).split(b"\n")
        self._tail = lines.pop()
        for line in lines:
            if line.startswith(STAMP):
                self._last, self.stamps = float(line[len(STAMP) :]), self.stamps + 1
            elif line == b"event: message_start" and self.message_start_sent is None:
                self.message_start_sent = self._last
            elif line == b"event: message_delta" and self.message_delta_sent is None:
                self.message_delta_sent = self._last
            elif line == b"event: content_block_delta" and self.first_delta_sent is None:
                self.first_delta_sent, self.first_delta_received = self._last, time.time()


class _Tee(httpx2.SyncByteStream):
    def __init__(self, inner: httpx2.SyncByteStream, record: SendTimes) -> None:
        self.inner, self.record = inner, record

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.inner:
            self.record.feed(chunk)
            yield chunk

    def close(self) -> None:
        self.inner.close()


class SendTimesTransport(httpx2.HTTPTransport):
    """The SDK's transport, with a tee on /v1/messages responses into `self.record`."""

    record: SendTimes | None = None

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = super().handle_request(request)
        if self.record is not None and request.url.path.endswith("/v1/messages"):
            response.stream = _Tee(response.stream, self.record)  # type: ignore[arg-type]
        return response
