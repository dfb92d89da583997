"""The engine as the server sees it: `async for delta in engine.generate(...)`.

The model and step loop run in a separate process (see DESIGN.md: an engine thread next to
a busy event loop loses most of its steps to the GIL). This side owns one socket to it,
read by the event loop, and routes each step's deltas to the waiting streams. One
`AsyncEngine` is one engine process's life: when it dies, every stream and call fails with
`EngineDeadError`; `zerohop.engine.process.supervisor` starts the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import subprocess
import sys
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Unpack

from zerohop.engine.base.errors import EngineDeadError, InvalidRequestError
from zerohop.engine.base.options import EngineOptions
from zerohop.engine.base.outputs import EngineInfo, EngineStatsDict, RequestDelta
from zerohop.engine.client import DEFAULT_OPTIONS, Queued, RequestOptions
from zerohop.engine.process.messages import (
    Abort,
    Add,
    Added,
    Call,
    Deltas,
    Fatal,
    FromEngine,
    Ready,
    Rejected,
    Reply,
    Shutdown,
    Start,
    ToEngine,
    from_engine,
    to_wire,
)
from zerohop.engine.process.wire import HEADER, pack, unpack
from zerohop.engine.sample.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# Seconds an engine process may take from spawn to "ready" (vLLM's engine-ready wait is
# 600 s too): a first start may build the CPU kernels (~30 s quiet, minutes on a busy
# machine) and load a large file; past it the start has failed.
DEFAULT_START_TIMEOUT = 600.0


@dataclass(slots=True)
class _Stream:
    queue: asyncio.Queue[RequestDelta | Exception]
    finished: bool = False


class AsyncEngine:
    def __init__(self) -> None:
        self.info: EngineInfo = {}  # the engine process's, once it is ready
        # The engine's counters after its latest step: current within one step, and read
        # without asking the engine process (which answers calls only between steps, seconds
        # apart during a long prefill).
        self.latest_stats: EngineStatsDict | None = None
        self.dead: str | None = None
        self._streams: dict[str, _Stream] = {}
        # Requests sent whose first delta has not come back: the queue as this side sees it,
        # current to the moment (the engine's own counters are a step old).
        self.queued: dict[str, Queued] = {}
        self._calls: dict[int, asyncio.Future[EngineStatsDict | None]] = {}
        self._call_ids = itertools.count()
        self._process: subprocess.Popen[bytes] | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None

    @classmethod
    async def start(
        cls,
        model_path: str,
        start_timeout: float = DEFAULT_START_TIMEOUT,
        **engine_options: Unpack[EngineOptions],
    ) -> AsyncEngine:
        """Spawn the engine process and wait until it has loaded and warmed up the model:
        at most `start_timeout` seconds, after which the process is killed and the start
        has failed (an engine that hangs while starting must not leave /ready 503 forever)."""
        self = cls()
        parent, child = socket.socketpair()
        # A fresh interpreter (not multiprocessing's spawn, which re-imports __main__).
        self._process = subprocess.Popen(
            [sys.executable, "-m", "zerohop.engine.process.engine_process", str(child.fileno())],
            pass_fds=[child.fileno()],
            env=_engine_environment(),
        )
        child.close()
        try:
            reader, self._writer = await asyncio.open_connection(sock=parent)
            self._send(Start(str(model_path), engine_options))
            first = await asyncio.wait_for(_read_message(reader), start_timeout)
        except TimeoutError:
            await self._kill()
            raise RuntimeError(
                f"engine failed to start: not ready within {start_timeout:g} s"
                " (--engine-start-timeout)"
            ) from None
        except BaseException:  # cancelled (the server stops while it starts): no orphan
            await self._kill()
            raise
        if not isinstance(first, Ready):
            await self.shutdown()
            reason = (
                first.message
                if isinstance(first, Fatal)
                else "the engine process exited during start-up"
                if first is None
                else f"it answered {type(first).__name__} before Ready"
            )
            raise RuntimeError(f"engine failed to start: {reason}")
        self.info = first.info
        self._reader_task = asyncio.create_task(self._read_loop(reader))
        return self

    async def _kill(self) -> None:
        assert self._process is not None
        self._process.kill()
        await asyncio.to_thread(self._process.wait)

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    async def wait_closed(self) -> str:
        """Wait until the engine process has gone (exited, killed or shut down): why."""
        task = self._reader_task
        if task is not None:
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                if not task.cancelled():  # this waiter was cancelled, not the reader
                    raise
            except Exception:
                log.exception("engine reader failed")
        return self.dead or "the engine process exited"

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        announce: bool = False,
        options: RequestOptions = DEFAULT_OPTIONS,
    ) -> AsyncGenerator[RequestDelta, None]:
        """Yield each step's delta for this request; leaving early aborts it in the engine.

        With `announce`, the first item is the engine's acknowledgement (`delta.admitted`, no
        tokens) once it has accepted the request; a rejection raises instead.

        With `params.n` > 1 the deltas of every choice come here (`delta.index`); the stream
        ends when each has finished, or at the first that failed or was aborted (the
        others are then aborted)."""
        if self.dead:
            raise EngineDeadError(self.dead)
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        stream = _Stream(asyncio.Queue())
        self._streams[request_id] = stream
        self._send(Add(request_id, prompt_token_ids, params, options))
        self.queued[request_id] = options.queued(len(prompt_token_ids))
        unfinished = set(range(params.n))
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    raise item
                if item.admitted:  # still queued until its first step
                    if announce:
                        yield item
                    continue
                self._dequeue(request_id)
                yield item
                if item.finished:
                    unfinished.discard(item.index)
                    stream.finished = not unfinished
                    if stream.finished or item.finish_reason in ("abort", "error"):
                        return
        finally:
            self._dequeue(request_id)
            self._streams.pop(request_id, None)
            if not stream.finished and not self.dead:
                self._send(Abort(request_id))

    def _dequeue(self, request_id: str) -> None:
        self.queued.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        if not self.dead:
            self._send(Abort(request_id))

    async def call(self, name: str) -> EngineStatsDict | None:
        """Ask the engine process for something (`stats`; None: it has no such call)."""
        if self.dead:
            raise EngineDeadError(self.dead)
        call_id = next(self._call_ids)
        future: asyncio.Future[EngineStatsDict | None] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._send(Call(call_id, name))
        return await future

    async def stats(self) -> EngineStatsDict:
        stats = await self.call("stats")
        if stats is None:
            raise RuntimeError("the engine process does not answer 'stats'")
        return stats

    def _send(self, message: ToEngine) -> None:
        assert self._writer is not None
        self._writer.write(pack(to_wire(message)))

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        reason = "the engine process exited"
        try:
            while (message := await _read_message(reader)) is not None:
                if isinstance(message, Fatal):
                    reason = f"the engine process failed: {message.message}"
                    break
                self._dispatch(message)
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            reason = f"lost the engine process: {exc}"
        except Exception as exc:  # a message this side cannot read: the process is no use
            log.exception("engine process: unreadable message")
            reason = f"lost the engine process: {type(exc).__name__}"
        self._mark_dead(reason)

    def _dispatch(self, message: FromEngine) -> None:
        match message:
            case Deltas(deltas, stats):
                if stats is not None:
                    self.latest_stats = stats
                for delta in deltas:
                    self._deliver(delta.request_id, delta)
            case Added(request_id, prompt_tokens, cached_tokens):
                admitted = RequestDelta(request_id, num_prompt_tokens=prompt_tokens, admitted=True)
                admitted.cached_tokens = cached_tokens
                self._deliver(request_id, admitted)
            case Rejected(request_id, text):
                stream = self._streams.get(request_id)
                if stream is not None:
                    stream.finished = True
                self._deliver(request_id, InvalidRequestError(text))
            case Reply(call_id, value):
                future = self._calls.pop(call_id, None)
                if future is not None and not future.done():
                    future.set_result(value)
            case _:
                log.warning("engine process: unexpected %s", type(message).__name__)

    def _deliver(self, request_id: str, item: RequestDelta | Exception) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.queue.put_nowait(item)

    def _mark_dead(self, reason: str, expected: bool = False) -> None:
        if self.dead:
            return
        self.dead = reason
        if not expected:
            log.error("%s", reason)
        for stream in self._streams.values():
            stream.queue.put_nowait(EngineDeadError(reason))
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        self._calls.clear()

    async def shutdown(self, timeout: float = 10.0) -> None:
        if self._writer is not None and not self.dead:
            with contextlib.suppress(ConnectionError, RuntimeError):
                self._send(Shutdown())
                await self._writer.drain()
        self._mark_dead("the engine was shut down", expected=True)
        if self._process is not None:
            try:
                await asyncio.to_thread(self._process.wait, timeout)
            except subprocess.TimeoutExpired:
                self._process.kill()
        if self._reader_task is not None:
            self._reader_task.cancel()
        if self._writer is not None:
            self._writer.close()


def _engine_environment() -> dict[str, str]:
    # OpenMP threads that spin while they wait lose their time slices to the API process
    # on a small machine: measured 5-10x slower steps under load. Sleeping waits don't.
    return {"OMP_WAIT_POLICY": "PASSIVE", **os.environ}


async def _read_message(reader: asyncio.StreamReader) -> FromEngine | None:
    """The next message from the engine process; None when it has closed the socket."""
    try:
        header = await reader.readexactly(HEADER.size)
        (size,) = HEADER.unpack(header)
        return from_engine(unpack(await reader.readexactly(size)))
    except asyncio.IncompleteReadError:
        return None
