"""A TCP proxy in front of a live server that cuts a connection where a marker appears in
the server's bytes: what came before it is delivered, then the connection closes. A test
of mid-stream failover can so break a stream between two exact events (a SIGKILL cannot:
the server writes a stream's last events together), with a real server behind it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager


async def _pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, marker: bytes = b""
) -> None:
    held = b""  # the end of the bytes read, which may be where the marker starts
    try:
        while chunk := await reader.read(65536):
            data = held + chunk
            if marker and (at := data.find(marker)) >= 0:
                writer.write(data[:at])
                await writer.drain()
                return
            cut = len(data) - len(marker) + 1 if marker else len(data)
            writer.write(data[:cut])
            held = data[cut:]
            await writer.drain()
        writer.write(held)
        await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


@contextmanager
def cutting_proxy(upstream_port: int, marker: bytes) -> Iterator[str]:
    """A proxy to 127.0.0.1:`upstream_port` that cuts each response at `marker`; its URL."""
    loop = asyncio.new_event_loop()

    async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", upstream_port)
        await asyncio.gather(_pipe(up_reader, writer, marker), _pipe(reader, up_writer))

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    start = asyncio.start_server(connected, "127.0.0.1", 0)
    server = asyncio.run_coroutine_threadsafe(start, loop).result(10)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        asyncio.run_coroutine_threadsafe(_stop(server), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


async def _stop(server: asyncio.Server) -> None:
    server.close()
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
