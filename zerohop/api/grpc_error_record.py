"""The gRPC half of `error_record`: an interceptor that writes down each call's non-OK
status and details when ZEROHOP_ERROR_RECORD is set."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc

from zerohop.api.error_record import record_path, write


def grpc_interceptors() -> list[grpc.aio.ServerInterceptor]:
    path = record_path()
    return [] if path is None else [_GrpcErrors(path)]


class _GrpcErrors(grpc.aio.ServerInterceptor):
    """Records each call's non-OK status: aborts and set_code when the call is done, and an
    exception no handler caught as grpc.aio words it ("Unexpected <class ...>: ...")."""

    def __init__(self, path: Path) -> None:
        self.path = path

    async def intercept_service(
        self, continuation: Callable, details: grpc.HandlerCallDetails
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

    def _wrap(self, behavior: Callable, method: str) -> Callable:
        if inspect.isasyncgenfunction(behavior):
            return self._wrap_generator(behavior, method)
        if not inspect.iscoroutinefunction(behavior):
            return behavior  # a synchronous handler: none is registered here

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            self._watch(context, method)
            try:
                return await behavior(request, context)
            except Exception as exc:
                self._unexpected(method, exc)
                raise

        return call

    def _wrap_generator(self, behavior: Callable, method: str) -> Callable:
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator:
            self._watch(context, method)
            try:
                async for message in behavior(request, context):
                    yield message
            except Exception as exc:
                self._unexpected(method, exc)
                raise

        return stream

    def _watch(self, context: grpc.aio.ServicerContext, method: str) -> None:
        def done(ended: grpc.aio.ServicerContext) -> None:
            code = ended.code()
            if code is not None and code != grpc.StatusCode.OK:
                write(self.path, "grpc", method, code.name, ended.details() or "")

        context.add_done_callback(done)

    def _unexpected(self, method: str, exc: Exception) -> None:
        if isinstance(exc, grpc.aio.AbortError):
            return  # recorded when the call is done, with the status it set
        write(self.path, "grpc", method, "UNKNOWN", f"Unexpected {type(exc)}: {exc}")
