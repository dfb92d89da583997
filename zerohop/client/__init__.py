"""zerohop's direct multi-replica client: it finds replicas (a list, DNS, a watched file),
checks their health in the background, keeps prompts on the replica that caches their prefix
(bounded by load), and fails over, mid-stream too. The httpx transports give the official
SDKs all of this unchanged:

    import anthropic, zerohop.client
    client = anthropic.Anthropic(
        base_url="http://zerohop",  # a name only: the pool chooses the replica
        http_client=zerohop.client.http_client(["http://10.0.0.1:8000", "grpc://10.0.0.2:50051"]),
    )

Imports zerohop.sse and zerohop.grpc_gen only, so it runs without the server; nothing of
zerohop imports it.
"""

from zerohop.client.affinity import AffinityPolicy, RoundRobinPolicy
from zerohop.client.api import ApiStatusError, AsyncClient, AsyncStream, Client, Stream
from zerohop.client.failover import FailoverPolicy
from zerohop.client.pool import ReplicaPool
from zerohop.client.transport import (
    AsyncFailoverTransport,
    FailoverTransport,
    async_http_client,
    http_client,
)

__all__ = [
    "AffinityPolicy",
    "ApiStatusError",
    "AsyncClient",
    "AsyncFailoverTransport",
    "AsyncStream",
    "Client",
    "FailoverPolicy",
    "FailoverTransport",
    "ReplicaPool",
    "RoundRobinPolicy",
    "Stream",
    "async_http_client",
    "http_client",
]
