"""Connection protection a reverse proxy used to give: caps and a request-head deadline.

zerohop stands directly on the network, so it does nginx's `limit_conn` and
`client_header_timeout` itself, on uvicorn's zttp protocols (HTTP/1.1 and HTTP/2):
- a cap on open connections, globally and per client address: a connection over either is
  closed at once, before any byte is read, and the connections being served are untouched;
- a deadline for the request head: once bytes of a request arrive on a connection with no
  request in progress, the head must be complete within `header_timeout` seconds, or the
  connection is answered 408 (HTTP/1.1) or closed. A client that opens a connection and
  sends nothing is closed by uvicorn's keep-alive timeout (`timeout_keep_alive`);
- HTTP/2: a cap on concurrent streams per connection (streams over it are refused with
  REFUSED_STREAM; zttp advertises 128 in SETTINGS and offers no way to change that), and a
  budget per connection of client stream resets (rapid reset) and of SETTINGS/PING frames,
  past which
  the connection gets GOAWAY (ENHANCE_YOUR_CALM) and is closed, so a reset loop cannot
  make the engine admit and abort requests without bound.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import zttp
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from uvicorn.protocols.http.auto_zttp_impl import AutoZttpProtocol
from uvicorn.protocols.http.zttp_h2_impl import ZttpH2Protocol
from uvicorn.protocols.http.zttp_impl import ZttpProtocol

log = logging.getLogger(__name__)
REFUSED_STREAM, ENHANCE_YOUR_CALM = 0x7, 0xB  # HTTP/2 error codes (RFC 9113 section 7)
_TOO_LARGE_BODY = b'{"error":"the request head is larger than the server accepts"}'
_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\nserver: zerohop\r\n"
    b"content-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
    % (len(_TOO_LARGE_BODY), _TOO_LARGE_BODY)
)
_TIMEOUT_BODY = b'{"error":"the request head took too long to arrive"}'
_REQUEST_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\nserver: zerohop\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_TIMEOUT_BODY), _TIMEOUT_BODY)
)


@dataclass(slots=True)
class GuardLimits:
    max_connections: int = 4096
    max_connections_per_address: int = 256
    header_timeout: float = 20.0  # seconds for a request head, as nginx's client_header_timeout
    # Concurrent streams on one HTTP/2 connection. zttp advertises and enforces 128 itself
    # (there is no API to change its SETTINGS), so a cap above 128 cannot take effect.
    http2_max_streams: int = 128
    # Abuse budgets per HTTP/2 connection, per `abuse_window` seconds: client stream resets
    # (rapid reset, CVE-2023-44487) and SETTINGS/PING frames. Past one: GOAWAY and close.
    http2_max_resets: int = 200
    http2_max_control_frames: int = 1000
    abuse_window: float = 10.0


@dataclass(slots=True)
class ConnectionGuard:
    """The server's connection counts and what it refused (for the metrics)."""

    limits: GuardLimits
    open: int = 0
    per_address: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)  # reason -> connections refused
    closed_slow: int = 0  # connections closed by the head deadline
    closed_abusive: Counter[str] = field(default_factory=Counter)  # reason -> HTTP/2 GOAWAYs
    streams_refused: int = 0  # HTTP/2 streams over the per-connection cap

    def admit(self, address: str | None) -> str | None:
        """Count a new connection in; or the reason it is refused."""
        if self.open >= self.limits.max_connections:
            reason = "max_connections"
        elif address is not None and (
            self.per_address[address] >= self.limits.max_connections_per_address
        ):
            reason = "max_connections_per_address"
        else:
            self.open += 1
            if address is not None:
                self.per_address[address] += 1
            return None
        self.refused[reason] += 1
        return reason

    def release(self, address: str | None) -> None:
        self.open -= 1
        if address is not None:
            self.per_address[address] -= 1
            if self.per_address[address] <= 0:
                del self.per_address[address]


class GuardMetrics(Collector):
    """The guard's counters as Prometheus metrics, read at scrape time: registered on the
    registry `GET /metrics` renders (`GatewayMetrics.register`)."""

    def __init__(self, guard: ConnectionGuard) -> None:
        self.guard = guard

    def describe(self) -> Iterator[Metric]:  # the names, so a second registration is refused
        return self.collect()

    def collect(self) -> Iterator[Metric]:
        guard = self.guard
        yield GaugeMetricFamily(
            "zerohop_connections_open", "HTTP connections open now.", value=guard.open
        )
        family = CounterMetricFamily(
            "zerohop_connections_refused", "Connections refused at once, by cap.",
            labels=("reason",),
        )  # fmt: skip
        for reason in ("max_connections", "max_connections_per_address"):
            family.add_metric((reason,), guard.refused[reason])
        yield family
        yield CounterMetricFamily(
            "zerohop_connections_timed_out",
            "Connections closed by the head deadline.",
            value=guard.closed_slow,
        )
        family = CounterMetricFamily(
            "zerohop_http2_goaway", "HTTP/2 connections closed for abuse, by reason.",
            labels=("reason",),
        )  # fmt: skip
        for what in ("resets", "control_frames"):
            family.add_metric((what,), guard.closed_abusive[what])
        yield family
        yield CounterMetricFamily(
            "zerohop_http2_streams_refused",
            "Streams over the per-connection cap.",
            value=guard.streams_refused,
        )


def raise_file_limit(limits: GuardLimits) -> str | None:
    """Raise the open-file limit to its hard limit; a warning if the caps do not fit in it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    needed = limits.max_connections + 64  # listening sockets, the engine pipe, files, gRPC
    if soft == resource.RLIM_INFINITY or needed <= soft:
        return None
    return (
        f"--max-connections {limits.max_connections} does not fit in the open-file limit"
        f" ({soft}, the hard limit): lower it, or raise `ulimit -Hn`"
    )


class _Deadline:
    """The head deadline of one connection, armed while a request head is awaited."""

    def __init__(self, protocol: Any, guard: ConnectionGuard) -> None:
        self.protocol, self.guard = protocol, guard
        self.timer: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        if self.timer is None:
            loop = asyncio.get_running_loop()
            self.timer = loop.call_later(self.guard.limits.header_timeout, self._expired)

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expired(self) -> None:
        self.timer = None
        self.guard.closed_slow += 1
        transport = self.protocol.transport
        if transport is None or transport.is_closing():
            return
        if isinstance(self.protocol, ZttpProtocol):
            transport.write(_REQUEST_TIMEOUT)
        transport.close()


class _Guarded:
    """Mixin for the zttp protocols: count the connection, watch the head deadline."""

    guard: ConnectionGuard
    address: str | None = None
    deadline: _Deadline

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]  # the zttp protocol's
        self.deadline = _Deadline(self, self.guard)
        self.deadline.arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self.deadline.disarm()
        self.guard.release(self.address)
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        if self._idle():
            self.deadline.arm()
        super().data_received(data)  # type: ignore[misc]
        if not self._idle():
            self.deadline.disarm()

    def _idle(self) -> bool:
        raise NotImplementedError


class GuardedH1(_Guarded, ZttpProtocol):
    def _idle(self) -> bool:
        cycle = self.cycle
        return cycle is None or cycle.response_complete

    def handle_remote_protocol_error(self) -> None:
        # Called inside the parser's `except`: a head past zttp's size limit (16 KiB) is a
        # 431, as nginx answers it, not a generic 400.
        error = sys.exc_info()[1]
        if error is not None and "size limit" in str(error):
            self.transport.write(_TOO_LARGE)
            self.transport.close()
            return
        super().handle_remote_protocol_error()

    def send_400_response(self, msg: str) -> None:
        body = b'{"error":"invalid HTTP request"}'
        self.transport.write(
            b"HTTP/1.1 400 Bad Request\r\nserver: zerohop\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        )
        self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Kept alive: uvicorn's idle timer runs; the head deadline starts with the next byte.


class GuardedH2(_Guarded, ZttpH2Protocol):
    """HTTP/2 with a stream cap, and GOAWAY for rapid reset and control-frame floods."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.budgets = {"resets": _Budget(), "control_frames": _Budget()}

    def _idle(self) -> bool:
        return not self.cycles

    def events(self) -> Any:
        limits = self.guard.limits
        for event in super().events():
            if isinstance(event, zttp.Settings | zttp.Ping) and self._spend(
                "control_frames", limits.http2_max_control_frames
            ):
                return
            yield event

    def handle_request(self, event: zttp.Request) -> None:
        if len(self.cycles) >= self.guard.limits.http2_max_streams:
            self.guard.streams_refused += 1
            self.conn.stream(event.stream_id).reset(REFUSED_STREAM)
            self.flush()
            return
        super().handle_request(event)

    def handle_rst_stream(self, event: zttp.RstStream) -> None:
        cycle = self.cycles.get(event.stream_id)
        cancelled = cycle is not None and not cycle.response_complete
        super().handle_rst_stream(event)
        if cancelled:  # a stream the client opened and dropped before its answer
            self._spend("resets", self.guard.limits.http2_max_resets)

    def _spend(self, what: str, allowed: int) -> bool:
        """Count one `what`; past its budget in the window, GOAWAY and close: True."""
        if self.budgets[what].spend(self.loop.time(), self.guard.limits.abuse_window) <= allowed:
            return False
        if not self.transport.is_closing():
            self.guard.closed_abusive[what] += 1
            log.warning("HTTP/2 client %s: too many %s, closing", self.address, what)
            self.conn.close(ENHANCE_YOUR_CALM)
            self.flush()
            self.transport.close()
        return True


@dataclass(slots=True)
class _Budget:
    """Events in the current window (a fixed window: cheap, and enough to bound abuse)."""

    started: float = 0.0
    count: int = 0

    def spend(self, now: float, window: float) -> int:
        if now - self.started > window:
            self.started, self.count = now, 0
        self.count += 1
        return self.count


class GuardedAutoProtocol(AutoZttpProtocol):
    """uvicorn's HTTP/1.1-or-HTTP/2 dispatcher, counting connections and guarding heads."""

    guard: ConnectionGuard  # set by `guarded_protocol`

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        peer = transport.get_extra_info("peername")
        self.address = peer[0] if isinstance(peer, tuple) else None
        refusal = self.guard.admit(self.address)
        if refusal is not None:
            self._refused = True
            transport.abort()  # at once: no read, no response, nothing held
            return
        self._refused = False
        # Until the first bytes say HTTP/1.1 or HTTP/2, uvicorn closes a silent connection
        # after its keep-alive timeout; from then on the chosen protocol's deadline applies.
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if getattr(self, "_refused", True):
            return
        self.guard.release(self.address)  # never switched: the chosen protocol releases
        super().connection_lost(exc)

    def _switch(self, http2: bool, initial_data: bytes = b"") -> None:
        protocol_class = GuardedH2 if http2 else GuardedH1
        protocol = protocol_class(
            config=self.config,
            server_state=self.server_state,
            app_state=self.app_state,
            _loop=self.loop,
        )
        protocol.guard, protocol.address = self.guard, self.address
        self.transport.set_protocol(protocol)
        protocol.connection_made(self.transport)
        if initial_data:
            protocol.data_received(initial_data)


def guarded_protocol(guard: ConnectionGuard) -> type[GuardedAutoProtocol]:
    """A protocol class for uvicorn (`config.http_protocol_class`) bound to `guard`."""
    return type("ZerohopProtocol", (GuardedAutoProtocol,), {"guard": guard})
