"""A gRPC call's peer and metadata in the shape the trusted front's parser reads
(api/http/trusted_front.py), so a front's end user is named on gRPC as on HTTP."""

from __future__ import annotations

import grpc


def peer_host(peer: str | None) -> str | None:
    """The IP address of a gRPC peer (`ipv4:127.0.0.1:5000`, `ipv6:[::1]:5000`); None for a
    unix socket or anything else, which is never a trusted front."""
    kind, _, rest = (peer or "").partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0] or None
    if kind == "ipv6":
        host = rest.rpartition(":")[0]
        return host.strip("[]").split("%")[0] or None  # a zone id is no part of the address
    return None


def front_headers(
    context: grpc.aio.ServicerContext,
) -> tuple[tuple[str, int] | None, list[tuple[bytes, bytes]]]:
    """(peer, headers) for TrustedFront.end_user: metadata keys arrive lower-cased; a binary
    (`-bin`) value is no identity header and is left out."""
    host = peer_host(context.peer())
    headers = [
        (str(key).encode("latin-1"), value.encode("utf-8"))
        for key, value in context.invocation_metadata() or ()
        if isinstance(value, str)
    ]
    return ((host, 0) if host else None), headers
