"""uvicorn's WebSocket protocol (the `websockets` library's sans-I/O one) fitted to zerohop's
HTTP/1.1 protocol and its drain.

- The connection guard (guard.py) counted the connection when it arrived as HTTP/1.1 and
  armed its head deadline; an upgrade hands the transport to this protocol and the HTTP one
  never hears of the connection again. So this protocol disarms that deadline (a socket may
  stay quiet between responses) and releases the guard's count when the socket closes.
- Shutdown: uvicorn closes every WebSocket at once with 1012. Here the application is told
  instead (`DRAIN`, a message of its own in the ASGI receive queue): it finishes the
  response it is writing and closes with 1001 (going away), within the drain time.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

DRAIN = "zerohop.websocket.drain"  # the ASGI message type: the server is draining


@dataclass(slots=True, frozen=True)
class SocketLimits:
    """An application socket's limits (`zerohop serve --ws-idle-seconds`, `--ws-max-queued`)."""

    idle_timeout: float = 900.0  # seconds with no client message and no response running
    max_pending: int = 16  # messages read ahead of those answered (on every lane together)

    def __post_init__(self) -> None:
        if not self.idle_timeout > 0:
            raise ValueError(f"the idle timeout must be positive, not {self.idle_timeout}")
        if self.max_pending < 1:
            raise ValueError(f"the read-ahead must be at least 1, not {self.max_pending}")


class DrainingWebSocket(WebSocketsSansIOProtocol):
    _released: Any = None  # the guard's release of this connection's count, once upgraded

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Called by the HTTP/1.1 protocol before it hands the transport over: that protocol
        # is still the transport's own here.
        upgraded_from = getattr(transport, "get_protocol", lambda: None)()
        deadline = getattr(upgraded_from, "deadline", None)
        guard = getattr(upgraded_from, "guard", None)
        if deadline is not None:
            deadline.disarm()
        if guard is not None:
            address = upgraded_from.address  # type: ignore[union-attr]
            self._released = lambda: guard.release(address)
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        release, self._released = self._released, None
        if release is not None:
            release()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        if self.handshake_complete and not self.close_sent and not self.disconnected:
            self.queue.put_nowait({"type": DRAIN})  # type: ignore[misc, arg-type]  # ours
            return
        super().shutdown()
