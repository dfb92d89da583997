"""Length-prefixed msgpack frames between the API process and the engine process.

One frame per engine step carries every request's new tokens, never one frame per token.
"""

from __future__ import annotations

import select
import socket
import struct
from collections.abc import Iterator
from dataclasses import fields, replace
from typing import Any, cast

import msgpack

from zerohop.engine.base.outputs import RequestDelta
from zerohop.engine.client import RequestOptions
from zerohop.engine.sample.sampling_params import SamplingParams

HEADER = struct.Struct("<I")
_DELTA_FIELDS = [f.name for f in fields(RequestDelta)]
_PARAM_FIELDS = [f.name for f in fields(SamplingParams)]
_OPTION_FIELDS = [f.name for f in fields(RequestOptions)]


def pack(message: Any) -> bytes:
    payload = cast(bytes, msgpack.packb(message, use_bin_type=True))  # msgpack has no types
    return HEADER.pack(len(payload)) + payload


def unpack(payload: bytes) -> Any:
    return msgpack.unpackb(payload, raw=False, strict_map_key=False)


def delta_to_wire(delta: RequestDelta) -> list[Any]:
    return [getattr(delta, name) for name in _DELTA_FIELDS]


def delta_from_wire(values: list[Any]) -> RequestDelta:
    delta = RequestDelta(*values)
    if delta.new_logprobs is not None:
        delta.new_logprobs = [{int(k): v for k, v in d.items()} for d in delta.new_logprobs]
    return delta


def options_to_wire(options: RequestOptions) -> dict[str, Any]:
    return {name: getattr(options, name) for name in _OPTION_FIELDS}


def options_from_wire(values: dict[str, Any]) -> RequestOptions:
    options = RequestOptions(**values)
    return replace(options, continues=tuple(options.continues))


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    return {name: getattr(params, name) for name in _PARAM_FIELDS}


def params_from_wire(values: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**values)


class FrameSocket:
    """The engine process's blocking end: poll, read whole frames, write frames."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray()

    def wait(self, timeout: float | None) -> bool:
        """True when bytes are ready to read (or the peer closed) within `timeout` seconds."""
        if self._complete_frame_buffered():
            return True
        readable, _, _ = select.select([self.sock], [], [], timeout)
        return bool(readable)

    def read_available(self) -> list[Any] | None:
        """Every complete frame readable now; None when the peer has gone."""
        self.sock.setblocking(False)
        try:
            while True:
                chunk = self.sock.recv(1 << 20)
                if not chunk:
                    return None
                self.buffer += chunk
        except BlockingIOError:
            pass
        finally:
            self.sock.setblocking(True)
        return list(self._frames())

    def _complete_frame_buffered(self) -> bool:
        if len(self.buffer) < HEADER.size:
            return False
        size = int(HEADER.unpack_from(self.buffer)[0])
        return len(self.buffer) >= HEADER.size + size

    def _frames(self) -> Iterator[Any]:
        while self._complete_frame_buffered():
            (size,) = HEADER.unpack_from(self.buffer)
            payload = bytes(self.buffer[HEADER.size : HEADER.size + size])
            del self.buffer[: HEADER.size + size]
            yield unpack(payload)

    def send(self, message: Any) -> None:
        self.sock.sendall(pack(message))
