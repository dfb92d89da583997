"""Server send times in a stream, on request: what `zerohop probe` measures buffering with.

A streaming request that carries the header `zerohop-send-times: 1` gets, in front of the
event(s) of every body write, an SSE comment line with the server's clock just before the
write: `: zerohop-sent 1733011200.123456\\n` (Unix time in seconds, microseconds). SSE
clients skip comment lines, so the official SDKs read such a stream unchanged. A client that
pairs each event's send time with its own receive time sees any intermediary that holds
tokens back. Without the header the stream is untouched: the handler's `send` is not even
wrapped, so the per-token path costs nothing more.
"""

from __future__ import annotations

import time
from typing import Any

from zerohop.api.http.asgi import Scope, Send, header

SEND_TIMES_HEADER = b"zerohop-send-times"
STAMP_PREFIX = b": zerohop-sent "


def with_send_times(scope: Scope, send: Send) -> Send:
    """`send` itself, or one that stamps each body write when the request asked for it."""
    if header(scope, SEND_TIMES_HEADER) != b"1":
        return send

    async def stamping_send(message: dict[str, Any]) -> None:
        body = message.get("body")
        if message["type"] == "http.response.body" and body:
            message = {**message, "body": b"%s%.6f\n%s" % (STAMP_PREFIX, time.time(), body)}
        await send(message)

    return stamping_send
