"""WebSocket mode's counters in `GET /metrics` (registered by app/server.py)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from zerohop.api.responses.websocket import ResponsesSocket


class SocketMetrics(Collector):
    """Sockets open on `/v1/responses` now, and the responses they served."""

    def __init__(self, socket: ResponsesSocket) -> None:
        self.socket = socket

    def describe(self) -> Iterator[Metric]:  # the names, so a second registration is refused
        return self.collect()

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "zerohop_websockets_open",
            "WebSocket connections open on /v1/responses now.",
            value=self.socket.open,
        )
        yield CounterMetricFamily(
            "zerohop_websocket_responses",
            "Responses served over WebSockets (response.create messages answered).",
            value=self.socket.served,
        )
