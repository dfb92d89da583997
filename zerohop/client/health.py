"""Background health of one replica: the gRPC health service's Watch stream for `grpc://`
replicas (the server pushes every change), `GET /ready` polling for HTTP ones.

Health never sits on the request path: it only sets `Replica.ready`, which replica choice
reads. A ready answer is also the half-open probe that closes an open circuit breaker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
import httpx2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from zerohop.client.replica import HALF_OPEN, OPEN, Replica


def grpc_channel(url: str) -> grpc.aio.Channel:
    """A channel to a `grpc://` (plaintext) or `grpcs://` (TLS) replica."""
    target = url.split("://", 1)[1]
    if url.startswith("grpcs://"):
        return grpc.aio.secure_channel(target, grpc.ssl_channel_credentials())
    return grpc.aio.insecure_channel(target)


log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING


def set_ready(replica: Replica, ready: bool) -> None:
    if ready != replica.ready:
        log.info("replica %s is %s", replica.url, "ready" if ready else "not ready")
    replica.ready = ready
    breaker = replica.breaker
    # Half-open (choosing may have let it, unpicked, into that state) or due to be: a ready
    # answer is the probe that closes it.
    if ready and (breaker.state == HALF_OPEN or (breaker.state == OPEN and breaker.allows())):
        breaker.succeeded()


async def poll_http(replica: Replica, http: httpx2.AsyncClient, interval: float) -> None:
    """`GET /ready` every `interval` seconds until cancelled (200: ready)."""
    while True:
        try:
            response = await http.get(replica.url + "/ready", timeout=max(interval, 1.0))
            set_ready(replica, response.status_code == 200)
        except httpx2.HTTPError:
            set_ready(replica, False)
        await asyncio.sleep(interval)


async def watch_grpc(replica: Replica, retry_after: float) -> None:
    """Follow grpc.health.v1 Watch until cancelled; a broken stream means not ready, and the
    watch is started again after `retry_after` seconds."""
    while True:
        channel = grpc_channel(replica.url)
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            async for reply in stub.Watch(health_pb2.HealthCheckRequest(service="")):
                set_ready(replica, reply.status == SERVING)
            set_ready(replica, False)
        except grpc.aio.AioRpcError:
            set_ready(replica, False)
        finally:
            with contextlib.suppress(Exception):
                await channel.close()
        await asyncio.sleep(retry_after)
