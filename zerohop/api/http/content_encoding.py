"""Request bodies sent with `content-encoding` (gzip, deflate, br, zstd), decoded as they arrive.

Every decoder stops once its output passes the body limit: a decompression bomb is refused
(413) after inflating at most one bounded piece past the limit, never whole. Codex sends zstd
bodies; the others are what HTTP clients and proxies use.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import IO, Protocol, cast

import brotli
import zstandard

from zerohop.api.errors import ApiError

SUPPORTED = (b"gzip", b"deflate", b"br", b"zstd")
# RFC 9110 15.5.16: a 415 for an unsupported coding says which ones would have been accepted.
_ACCEPTED = [(b"accept-encoding", b", ".join(SUPPORTED))]
_ZSTD_PIECE = 64 * 1024  # how much zstd output is inflated between two checks of the cap


class Decoder(Protocol):
    """Bytes in, decoded bytes out; `finish` once the body has ended."""

    def feed(self, data: bytes) -> bytes: ...

    def finish(self) -> bytes: ...


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the decompressed request body is larger than the limit of {limit} bytes")


def invalid(name: str) -> ApiError:
    return ApiError(400, f"the request body is not valid {name} data (content-encoding: {name})")


class _Cap:
    """The decoded bytes one decoder has produced, and the limit on them."""

    __slots__ = ("limit", "size")

    def __init__(self, limit: int) -> None:
        self.limit, self.size = limit, 0

    @property
    def room(self) -> int:
        """The most a decoder may produce next: one byte past the limit tells it was passed."""
        return self.limit - self.size + 1

    def add(self, out: bytes) -> bytes:
        self.size += len(out)
        if self.size > self.limit:
            raise too_large(self.limit)
        return out


class _Zlib:
    """gzip (several members allowed, as `gzip` writes them appended) and deflate (the zlib
    wrapper RFC 9110 names, or raw deflate, which some clients send instead)."""

    __slots__ = ("cap", "inner", "name", "started", "wbits")

    def __init__(self, name: str, limit: int) -> None:
        self.cap, self.name = _Cap(limit), name
        self.wbits = 31 if name == "gzip" else 15
        self.inner = zlib.decompressobj(self.wbits)
        self.started = False

    def feed(self, data: bytes) -> bytes:
        out = []
        while data:
            if self.inner.eof:  # a further gzip member, or trailing bytes
                if self.name != "gzip":
                    raise invalid(self.name)
                self.inner = zlib.decompressobj(self.wbits)
            try:
                piece = self.inner.decompress(data, self.cap.room)
            except zlib.error:
                if self.started or self.name != "deflate" or self.wbits < 0:
                    raise invalid(self.name) from None
                self.wbits = -15  # raw deflate: start over without the zlib header
                self.inner = zlib.decompressobj(self.wbits)
                continue
            self.started = True
            out.append(self.cap.add(piece))
            # With room = limit + 1, input is left over only where the cap was passed.
            data = self.inner.unused_data
        return b"".join(out)

    def finish(self) -> bytes:
        if not self.inner.eof:
            raise invalid(self.name)  # cut short
        return b""


class _Brotli:
    __slots__ = ("cap", "inner")

    def __init__(self, limit: int) -> None:
        self.cap, self.inner = _Cap(limit), brotli.Decompressor()

    def feed(self, data: bytes) -> bytes:
        out = []
        try:
            out.append(self.cap.add(self.inner.process(data, output_buffer_limit=self.cap.room)))
            while not self.inner.can_accept_more_data():
                out.append(self.cap.add(self.inner.process(b"", output_buffer_limit=self.cap.room)))
        except brotli.error:
            raise invalid("br") from None
        return b"".join(out)

    def finish(self) -> bytes:
        if not self.inner.is_finished():
            raise invalid("br")
        return b""


class _Sink:
    """Where zstandard's writer puts its output, one piece at a time: the cap is checked on
    each piece, so a bomb stops within one piece of the limit."""

    __slots__ = ("cap", "pieces")

    def __init__(self, limit: int) -> None:
        self.cap, self.pieces = _Cap(limit), list[bytes]()

    def write(self, data: bytes) -> int:
        self.pieces.append(self.cap.add(bytes(data)))
        return len(data)

    def take(self) -> bytes:
        out, self.pieces = b"".join(self.pieces), []
        return out


class _Zstd:
    # zstandard's decompressobj returns a chunk's whole output at once, with no limit; its
    # stream writer hands the output over piece by piece, so the cap can stop it.
    __slots__ = ("inner", "sink")

    def __init__(self, limit: int) -> None:
        self.sink = _Sink(limit)
        decompressor = zstandard.ZstdDecompressor()
        sink = cast("IO[bytes]", self.sink)  # it calls only `write`
        self.inner = decompressor.stream_writer(sink, write_size=_ZSTD_PIECE, closefd=False)

    def feed(self, data: bytes) -> bytes:
        try:
            self.inner.write(data)
        except zstandard.ZstdError:
            raise invalid("zstd") from None
        return self.sink.take()

    def finish(self) -> bytes:
        return b""


class _Chain:
    """`content-encoding: gzip, zstd`: the codings in the order they were applied, so the
    body is decoded last-applied first."""

    __slots__ = ("decoders",)

    def __init__(self, decoders: list[Decoder]) -> None:
        self.decoders = decoders

    def feed(self, data: bytes) -> bytes:
        for decoder in self.decoders:
            data = decoder.feed(data)
        return data

    def finish(self) -> bytes:
        data = b""
        for decoder in self.decoders:
            data = decoder.feed(data) + decoder.finish() if data else decoder.finish()
        return data


_MAKERS: dict[bytes, Callable[[int], Decoder]] = {
    b"gzip": lambda limit: _Zlib("gzip", limit),
    b"x-gzip": lambda limit: _Zlib("gzip", limit),
    b"deflate": lambda limit: _Zlib("deflate", limit),
    b"br": _Brotli,
    b"zstd": _Zstd,
}


def decoder_for(content_encoding: bytes | None, limit: int) -> Decoder | None:
    """The decoder for a request's `content-encoding` header, each coding's output capped at
    `limit` bytes; None for a plain body (no header, or only `identity`). 415 for a coding
    not supported here."""
    if content_encoding is None:
        return None
    codings = [c.strip().lower() for c in content_encoding.split(b",")]
    codings = [c for c in codings if c and c != b"identity"]
    for coding in codings:
        if coding not in _MAKERS:
            shown = coding.decode("latin-1")
            message = f"content-encoding '{shown}' is not supported; use gzip, deflate, br or zstd"
            raise ApiError(415, message, headers=list(_ACCEPTED))
    if not codings:
        return None
    decoders = [_MAKERS[coding](limit) for coding in reversed(codings)]
    return decoders[0] if len(decoders) == 1 else _Chain(decoders)
