"""httpx transports over a replica pool, so the official SDKs get failover unchanged:

    anthropic.Anthropic(base_url="http://zerohop", http_client=http_client(replicas=URLS))
    openai.OpenAI(base_url="http://zerohop/v1", http_client=http_client(replicas=URLS))

The host in the SDK's `base_url` is only a name: each request goes to the replica the pool
chooses, with the path, headers (the API key) and body the SDK built. The sync transport
runs its requests on the pool's own event loop and hands the caller a blocking stream.

Making a transport (or `http_client`) starts nothing: the pool starts with the first
request. Closing the client closes the transport's connections, and the pool when the
transport made it (`http_client(replicas)`); a pool the caller passed stays open.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx2

from zerohop.client.affinity import AffinityPolicy, RoundRobinPolicy
from zerohop.client.failover import Failover, FailoverPolicy
from zerohop.client.grpc_bridge import GrpcBridge
from zerohop.client.pool import ReplicaPool, Replicas, new_pool

DEFAULT_TIMEOUT = httpx2.Timeout(600.0, connect=2.0)  # connect fast: another replica waits


class _OverPool:
    """What both transports hold: the pool (closed with them when theirs) and a Failover
    with its own connections (HTTP, and gRPC channels for `grpc://` replicas)."""

    def __init__(
        self, pool: ReplicaPool, policy: FailoverPolicy | None = None, owns_pool: bool = False
    ) -> None:
        self.pool, self.owns_pool = pool, owns_pool
        http = _FirstUse(pool.verify)
        self.failover = Failover(pool, policy or FailoverPolicy(), http, GrpcBridge())


class _FirstUse(httpx2.AsyncBaseTransport):
    """An `httpx2.AsyncHTTPTransport` made at the first request (its TLS context reads the
    CA bundle), so that making a transport does no I/O."""

    def __init__(self, verify: bool | str) -> None:
        self.verify = verify
        self.http: httpx2.AsyncHTTPTransport | None = None

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        if self.http is None:
            self.http = httpx2.AsyncHTTPTransport(verify=self.verify)
        return await self.http.handle_async_request(request)

    async def aclose(self) -> None:
        if self.http is not None:
            await self.http.aclose()


class AsyncFailoverTransport(_OverPool, httpx2.AsyncBaseTransport):
    """For `httpx2.AsyncClient`, in the caller's event loop."""

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        return await self.failover.send(request)

    async def aclose(self) -> None:
        await self.failover.aclose()
        if self.owns_pool:
            await self.pool.aclose()


class FailoverTransport(_OverPool, httpx2.BaseTransport):
    """For `httpx2.Client`: each request runs on the pool's loop; the caller's thread waits."""

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        body = request.read()
        copy = httpx2.Request(
            request.method,
            request.url,
            headers=request.headers,
            content=body,
            extensions=request.extensions,
        )
        response = self.pool.run(self.failover.send(copy))
        stream = _BlockingStream(self.pool, response)
        return httpx2.Response(
            response.status_code,
            headers=response.headers,
            stream=stream,
            extensions=response.extensions,
        )

    def close(self) -> None:
        if self.pool.running:  # else it never opened a connection, or the pool closed them
            self.pool.run(self.failover.aclose())
        if self.owns_pool:
            self.pool.close()


class _BlockingStream(httpx2.SyncByteStream):
    def __init__(self, pool: ReplicaPool, response: httpx2.Response) -> None:
        self.pool, self.response = pool, response

    def __iter__(self) -> Iterator[bytes]:
        chunks = self.response.aiter_raw()
        while (chunk := self.pool.run(_next(chunks))) is not None:
            yield chunk

    def close(self) -> None:
        self.pool.run(self.response.aclose())


async def _next(chunks: AsyncIterator[bytes]) -> bytes | None:
    return await anext(chunks, None)


def http_client(
    replicas: Replicas | None = None,
    *,
    policy: FailoverPolicy | None = None,
    affinity: AffinityPolicy | RoundRobinPolicy | None = None,
    pool: ReplicaPool | None = None,
    **client_options: Any,
) -> httpx2.Client:
    """An `httpx2.Client` whose requests go to `replicas` with failover (a spec such as
    "dns+srv://_http._tcp.zerohop.default.svc.cluster.local", "file:urls.txt", or URLs), or
    over a `pool` the caller made (to share it, or to read its `stats()`)."""
    owns = pool is None
    pool = pool or new_pool(replicas, affinity)
    client_options.setdefault("timeout", DEFAULT_TIMEOUT)
    return httpx2.Client(transport=FailoverTransport(pool, policy, owns), **client_options)


def async_http_client(
    replicas: Replicas | None = None,
    *,
    policy: FailoverPolicy | None = None,
    affinity: AffinityPolicy | RoundRobinPolicy | None = None,
    pool: ReplicaPool | None = None,
    **client_options: Any,
) -> httpx2.AsyncClient:
    """The `httpx2.AsyncClient` counterpart of `http_client`."""
    owns = pool is None
    pool = pool or new_pool(replicas, affinity)
    client_options.setdefault("timeout", DEFAULT_TIMEOUT)
    return httpx2.AsyncClient(
        transport=AsyncFailoverTransport(pool, policy, owns), **client_options
    )
