"""Whole JSON answers compressed as the request's `accept-encoding` allows.

Only a complete `application/json` body of a 2xx answer, sent in one message, at least
MIN_SIZE bytes (nginx's gzip_min_length idea: below it the headers cost more than is saved),
and only where it comes out smaller. Streams (SSE) pass through untouched and unbuffered;
error bodies stay plain (they are small, and the error record reads them).
Levels: benchmarks/response_compression.py measured the CPU per answer of each.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import brotli
import zstandard

from zerohop.api.http.asgi import Scope, Send, header

MIN_SIZE = 1024
# Level 1 of each: on answers of 1.5-30 KB, higher levels cost 1.5-10x the CPU and save
# under 3 % (benchmarks/response_compression.py: gzip-1 ~40-60 us, br-1 ~10-45 us, zstd-1
# ~6-27 us an answer on this machine).
GZIP_LEVEL = 1
BROTLI_QUALITY = 1
ZSTD_LEVEL = 1


def _gzip(data: bytes) -> bytes:
    return zlib.compress(data, GZIP_LEVEL, wbits=31)


def _brotli(data: bytes) -> bytes:
    return bytes(brotli.compress(data, quality=BROTLI_QUALITY))


_ZSTD = zstandard.ZstdCompressor(level=ZSTD_LEVEL)

# Ours, best first among codings the client weighs the same: zstd compresses JSON smallest
# for the least CPU, then br, then gzip (see the benchmark).
COMPRESSORS: dict[bytes, Callable[[bytes], bytes]] = {
    b"zstd": _ZSTD.compress,
    b"br": _brotli,
    b"gzip": _gzip,
}


def _weights(accept_encoding: bytes) -> dict[bytes, float]:
    weights = {}
    for item in accept_encoding.lower().split(b","):
        coding, *params = item.split(b";")
        q = 1.0
        for param in params:
            key, _, value = param.partition(b"=")
            if key.strip() == b"q":
                try:
                    q = float(value.strip())
                except ValueError:
                    q = 0.0
        if coding := coding.strip():
            weights[coding] = q
    return weights


def choose(accept_encoding: bytes | None) -> bytes | None:
    """The coding to answer in (RFC 9110 12.5.3: q-values, `*`, `identity`); None: plain.
    No header means plain: compressing for a client that did not ask is not worth the risk."""
    if not accept_encoding:
        return None
    weights = _weights(accept_encoding)
    star = weights.get(b"*", 0.0)
    best, best_q = None, 0.0
    for coding in COMPRESSORS:
        q = weights.get(coding, weights.get(b"x-gzip", star) if coding == b"gzip" else star)
        if q > best_q:
            best, best_q = coding, q
    return best


def compress_responses(scope: Scope, send: Send) -> Send:
    """`send`, compressing a whole JSON answer where the request allows; `send` itself where
    it allows no coding (nothing added on that path)."""
    coding = choose(header(scope, b"accept-encoding"))
    return send if coding is None else _Compressing(send, coding)


def _eligible(start: dict[str, Any]) -> bool:
    if not 200 <= start["status"] < 300:
        return False
    json = False
    for key, value in start.get("headers", ()):
        if key == b"content-encoding":
            return False
        if key == b"content-type":
            json = value.startswith(b"application/json")
    return json


@dataclass(slots=True)
class _Compressing:
    """Holds a JSON answer's start until its body shows whether it is whole (one message)."""

    send: Send
    coding: bytes
    held: dict[str, Any] | None = None
    decided: bool = False

    async def __call__(self, message: dict[str, Any]) -> None:
        if self.decided:
            return await self.send(message)
        if message["type"] == "http.response.start" and _eligible(message):
            self.held = message
            return None
        self.decided = True
        start, self.held = self.held, None
        if start is None:
            return await self.send(message)
        body = message.get("body", b"")
        whole = message["type"] == "http.response.body" and not message.get("more_body")
        packed = COMPRESSORS[self.coding](body) if whole and len(body) >= MIN_SIZE else None
        headers = [*start.get("headers", ()), (b"vary", b"accept-encoding")]
        if packed is None or len(packed) >= len(body):
            await self.send({**start, "headers": headers})
            return await self.send(message)
        headers = [(k, v) for k, v in headers if k != b"content-length"]
        headers += [(b"content-encoding", self.coding), (b"content-length", b"%d" % len(packed))]
        await self.send({**start, "headers": headers})
        await self.send({**message, "body": packed})
