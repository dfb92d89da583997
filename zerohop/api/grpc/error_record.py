"""The gRPC half of `error_record`: an interceptor that writes down each call's non-OK
status and details when ZEROHOP_ERROR_RECORD is set."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc

from zerohop.api.http.error_record import record_path, write


def grpc_interceptors() -> list[grpc.aio.ServerInterceptor]:
    path = record_path()
    return [] if path is None else [_GrpcErrors(path)]


class _GrpcErrors(grpc.aio.ServerInterceptor):
    """Records each call's non-OK status: what abort() or set_code() set, and for an
    exception no handler caught, what grpc.aio sends ("Unexpected <class ...>: ...")."""

    def __init__(self, path: Path) -> None:
        self.path = path

    async def intercept_service(
        self, continuation: Callable[..., Any], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None:
            return None
        kinds = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
        wrapped = {
            kind: self._wrap(getattr(handler, kind), details.method)
            for kind in kinds
            if getattr(handler, kind) is not None
        }
        return handler._replace(**wrapped)

    def _wrap(self, behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behavior):
            return self._wrap_generator(behavior, method)
        if not inspect.iscoroutinefunction(behavior):
            return behavior  # a synchronous handler: none is registered here

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                result = await behavior(request, _Recording(context, self._writer(method)))
            except Exception as exc:
                self._failed(method, exc)
                raise
            self._ended(method, context)
            return result

        return call

    def _wrap_generator(self, behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async for message in behavior(request, _Recording(context, self._writer(method))):
                    yield message
            except Exception as exc:
                self._failed(method, exc)
                raise
            self._ended(method, context)

        return stream

    # Each is written before the call's status goes out (abort() sends it at once, a return
    # or an exception after the wrapper), so a client that has seen it finds it here.

    def _writer(self, method: str) -> Callable[[grpc.StatusCode, str], None]:
        return lambda code, details: write(self.path, "grpc", method, code.name, details)

    def _ended(self, method: str, context: grpc.aio.ServicerContext) -> None:
        """A handler that returned after set_code/set_details."""
        code = context.code()
        if code is not None and code != grpc.StatusCode.OK:
            write(self.path, "grpc", method, code.name, context.details() or "")

    def _failed(self, method: str, exc: Exception) -> None:
        if not isinstance(exc, grpc.aio.AbortError):  # an abort was recorded as it was made
            write(self.path, "grpc", method, "UNKNOWN", f"Unexpected {type(exc)}: {exc}")


class _Recording:
    """A call's context for its handler: the same, but an abort is recorded before it is sent."""

    def __init__(
        self, context: grpc.aio.ServicerContext, record: Callable[[grpc.StatusCode, str], None]
    ) -> None:
        self._context = context
        self._record = record

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def abort(
        self, code: grpc.StatusCode, details: str = "", *args: Any, **kwargs: Any
    ) -> None:
        self._record(code, details)
        await self._context.abort(code, details, *args, **kwargs)

    async def abort_with_status(self, status: grpc.Status) -> None:
        self._record(status.code, status.details)
        await self._context.abort_with_status(status)
