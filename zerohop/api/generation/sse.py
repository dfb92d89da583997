"""The one streamed-response loop of the HTTP surfaces: a generation's events, each encoded
by the surface's `StreamEncoder` and written the moment it comes.

The stream starts (status, headers, the encoder's opening) once the request is admitted, so a
refusal before that still gets its HTTP status. Then each step's bytes, a ping when one is
due, and the closing once every choice has finished. A failure after the start is written as
the API's in-stream error event; a client gone ends the stream without one.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from zerohop.api.errors import ApiError
from zerohop.api.generation.driver import Generation
from zerohop.api.generation.events import Admitted, Failed, GenerationEvent, Ping, Step
from zerohop.api.http.asgi import ClientDisconnected, Send, end_stream, send_chunk, start_stream

log = logging.getLogger(__name__)


class StreamEncoder(Protocol):
    """A surface's wire format for one streamed response."""

    ping: bytes

    def opening(self, admitted: Admitted) -> bytes:
        """What goes out at admission (Messages' message_start, Chat's role chunk)."""
        ...

    def step(self, step: Step) -> bytes:
        """A step's events (nothing when its output is held back)."""
        ...

    async def closing(self) -> bytes:
        """The stream's last bytes, once every choice has finished."""
        ...

    def failed(self, error: ApiError) -> bytes:
        """The API's in-stream error event."""
        ...


async def send_stream(
    generation: Generation,
    encoder: StreamEncoder,
    send: Send,
    headers: Sequence[tuple[bytes, bytes]],
) -> None:
    events = generation.events()
    async with contextlib.aclosing(events):
        admitted = await anext(events)  # errors before it become the HTTP status
        assert isinstance(admitted, Admitted)
        await start_stream(send, headers)
        if opening := encoder.opening(admitted):
            await send_chunk(send, opening)
        try:
            await end_stream(send, await _follow(generation, events, encoder, send))
        except ClientDisconnected:
            await end_stream(send)
            raise
        except ApiError as exc:
            await end_stream(send, encoder.failed(exc))
        except Exception:
            log.exception("request %s failed mid-stream", generation.call.request_id)
            await end_stream(send, encoder.failed(ApiError(500, "internal server error")))


async def _follow(
    generation: Generation,
    events: AsyncIterator[GenerationEvent],
    encoder: StreamEncoder,
    send: Send,
) -> bytes:
    """Each event written as it comes; the last step's bytes are held to go out with the
    closing, in one write."""
    async for event in events:
        if isinstance(event, Step):
            data = encoder.step(event)
            if generation.done:
                return data + await encoder.closing()
            if data:
                await send_chunk(send, data)
                generation.wrote()
        elif isinstance(event, Ping):
            await send_chunk(send, encoder.ping)
        elif isinstance(event, Failed):
            raise event.error
    return await encoder.closing()
