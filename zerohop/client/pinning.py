"""Keeping a request that names a replica's stored state on the replica that holds it.

Replicas that each keep their own store (SQLite, the default) hold only their own Messages
threads and stored Responses. A thread's continue carries only its new messages, and a
Responses turn only its `previous_response_id`, so prefix affinity alone could send them to
a replica that never saw the id (the API's 404 or 400). So the client learns which replica
answered each id it relays: a thread turn's message id (`message_start`'s, or a whole
answer's `id`) and a stored response's id (`response.created`'s, or a whole answer's), the
last `remember` of them. A request that names one (`thread.previous_message_id`,
`previous_response_id`, the `{id}` of `/v1/responses/{id}`, its `/cancel` and
`/input_items`) goes to that replica while it is usable. After a mid-stream failover the
continuing replica's opening event is learned as well: it names the id the caller holds (a
continued response is stored under the first replica's id; a thread turn that started over
is the caller's under the new replica's id), so later requests go where it is kept.

When that replica is down, or the id is not one this client relayed (another client's, or
one forgotten), the request is placed as any other: a fleet sharing a PostgreSQL store
(`zerohop serve --store`) serves it on any replica, and per-replica stores answer the API's
own 404, as after the id expired.

A whole answer's id is read from the bytes already buffered, only its first `HEAD_BYTES`
(decompressed that far, if compressed): the servers write `id` first. Other bodies are
parsed whole, once. Streams are never buffered: their first events are looked at as they
pass.
"""

from __future__ import annotations

import re
import threading
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import brotli
import orjson
import zstandard

from zerohop.client.replica import Replica
from zerohop.client.surfaces import Messages, Responses, Surface, event_data

HEAD_BYTES = 512
_FIRST_ID = re.compile(rb'\s*\{\s*"id"\s*:\s*"([^"\\]+)"')
_RESPONSE_PATH = re.compile(r"/v1/responses/([^/]+)(?:/cancel|/input_items)?/?$")
_ID_EVENTS = {"message_start": "message", "response.created": "response"}
_DECODE_ERRORS = (zlib.error, brotli.error, zstandard.ZstdError, ValueError, EOFError)


class Pins:
    """Which replica answered each id this client relayed: the last `remember` (least
    recently used forgotten; 0 remembers none, turning pinning off)."""

    def __init__(self, remember: int = 65536) -> None:
        self.remember = remember
        self._where: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()  # learned on the pool's loop and callers' loops alike

    def learn(self, answer_id: str | None, url: str) -> None:
        if answer_id is None or self.remember <= 0:
            return
        with self._lock:
            self._where[answer_id] = url
            self._where.move_to_end(answer_id)
            if len(self._where) > self.remember:
                self._where.popitem(last=False)

    def where(self, answer_id: str) -> str | None:
        with self._lock:
            url = self._where.get(answer_id)
            if url is not None:
                self._where.move_to_end(answer_id)
            return url

    def replica(self, answer_id: str | None, candidates: Sequence[Replica]) -> Replica | None:
        """The usable candidate that holds `answer_id`, if this client knows one."""
        url = None if answer_id is None else self.where(answer_id)
        return next((r for r in candidates if r.url == url and r.usable), None)


def named_id(method: str, path: str, surface: Surface | None) -> str | None:
    """The stored id a request builds on, if any."""
    if surface is None:
        match = _RESPONSE_PATH.search(path) if method in ("GET", "POST", "DELETE") else None
        return match.group(1) if match else None
    if isinstance(surface, Messages):
        thread = surface.payload.get("thread")
        if isinstance(thread, dict) and thread.get("type") == "continue":
            return _text(thread.get("previous_message_id"))
    elif isinstance(surface, Responses):
        return _text(surface.payload.get("previous_response_id"))
    return None


def learns(surface: Surface | None) -> bool:
    """Whether the answer's id names state its replica keeps: a thread turn, a stored
    response (`store` is true unless the request says otherwise)."""
    if isinstance(surface, Messages):
        return surface.payload.get("thread") is not None
    return isinstance(surface, Responses) and surface.payload.get("store") is not False


def id_in_event(event: bytes) -> str | None:
    """The answer's id, from the SSE event that opens a Messages or Responses stream."""
    if b'"message_start"' not in event and b'"response.created"' not in event:
        return None  # a plain byte search: every other event costs no parse
    data = event_data(event)
    try:
        message = orjson.loads(data) if data is not None else None
    except orjson.JSONDecodeError:
        return None
    if not isinstance(message, dict) or message.get("type") not in _ID_EVENTS:
        return None
    opened = message.get(_ID_EVENTS[message["type"]])
    return _text(opened.get("id")) if isinstance(opened, dict) else None


def id_in_body(raw: bytes, encoding: str) -> str | None:
    """A whole JSON answer's top-level `id`, from its raw (maybe compressed) bytes."""
    encoding = encoding.strip().lower()
    try:
        match = _FIRST_ID.match(_decoded(raw, encoding, HEAD_BYTES))
        if match:
            return match.group(1).decode()
        body = orjson.loads(_decoded(raw, encoding, None))
    except (*_DECODE_ERRORS, orjson.JSONDecodeError, UnicodeDecodeError):
        return None
    return _text(body.get("id")) if isinstance(body, dict) else None


def _decoded(raw: bytes, encoding: str, limit: int | None) -> bytes:
    """`raw` decoded from its content-encoding, its first `limit` bytes (None: all)."""
    if encoding in ("", "identity"):
        return raw if limit is None else raw[:limit]
    if encoding == "br":
        return bytes(brotli.decompress(raw)) if limit is None else _brotli_head(raw, limit)
    if encoding == "zstd":
        with zstandard.ZstdDecompressor().stream_reader(raw) as reader:
            return reader.read(-1 if limit is None else limit)
    if encoding in ("gzip", "x-gzip", "deflate"):
        # 47: a gzip or zlib header, told apart by zlib; raw deflate as httpx2 falls back to.
        bits = 47 if encoding != "deflate" or raw[:1] == b"\x78" else -zlib.MAX_WBITS
        return zlib.decompressobj(bits).decompress(raw, limit or 0)
    raise ValueError(f"content-encoding {encoding!r}")


def _brotli_head(raw: bytes, limit: int) -> bytes:
    """The first `limit` bytes or so: fed a slice at a time, since a Decompressor given
    the whole body reads all of it whatever its output limit."""
    decompressor, out = brotli.Decompressor(), bytearray()
    for start in range(0, len(raw), 256):
        out += decompressor.process(raw[start : start + 256], output_buffer_limit=limit)
        if len(out) >= limit:
            break
    return bytes(out)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None
