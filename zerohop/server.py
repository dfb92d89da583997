"""`zerohop serve`: the engine process, the HTTP server (HTTP/1.1, h2c, TLS+ALPN h2 on one
port) and the gRPC server, started in that order and drained in reverse on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn

from zerohop.api.app import create_app
from zerohop.api.service import DEFAULT_MAX_BODY_BYTES, ServingContext
from zerohop.engine.async_engine import AsyncEngine
from zerohop.engine.checkpoint import open_checkpoint

log = logging.getLogger("zerohop")


@dataclass(slots=True)
class ServeOptions:
    model_path: Path  # a Hugging Face folder or a GGUF file
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int | None = 50051
    tls_cert: str | None = None
    tls_key: str | None = None
    served_model_name: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    drain_seconds: float = 30.0
    engine_options: dict[str, Any] | None = None


class DrainingServer(uvicorn.Server):
    """uvicorn, but SIGTERM/SIGINT mark the server not-ready, drain, and exit 0.

    (uvicorn's own handlers re-raise the signal after shutdown, which exits non-zero.)
    """

    def __init__(self, config: uvicorn.Config, ctx: ServingContext) -> None:
        super().__init__(config)
        self.ctx = ctx

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.begin_drain)
        try:
            yield
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    def begin_drain(self) -> None:
        if self.ctx.draining:
            self.force_exit = True  # a second signal: stop waiting
        self.ctx.draining = True
        self.should_exit = True


async def serve(options: ServeOptions) -> int:
    engine_options = options.engine_options or {}
    # The engine process loads the weights while this one builds the tokenizer.
    starting = asyncio.create_task(AsyncEngine.start(str(options.model_path), **engine_options))
    try:
        checkpoint = await asyncio.to_thread(open_checkpoint, options.model_path)
        tokenizer = await asyncio.to_thread(checkpoint.tokenizer)
    except BaseException:
        with contextlib.suppress(Exception):
            await (await starting).shutdown()
        raise
    engine = await starting
    ctx = ServingContext(
        engine=engine,
        tokenizer=tokenizer,
        model_name=options.served_model_name or checkpoint.name,
        max_model_len=engine.info["max_model_len"],
        max_body_bytes=options.max_body_bytes,
    )
    server = DrainingServer(_uvicorn_config(options, ctx), ctx)
    grpc_server = None
    try:
        if options.grpc_port:
            from zerohop.api.grpc_service import start_grpc_server

            grpc_server = await start_grpc_server(ctx, options.host, options.grpc_port)
        _announce(options, ctx)
        await server.serve()
    finally:
        ctx.draining = True
        if grpc_server is not None:
            await grpc_server.stop(grace=min(options.drain_seconds, 5.0))
        await engine.shutdown()
    return 0


def _uvicorn_config(options: ServeOptions, ctx: ServingContext) -> uvicorn.Config:
    return uvicorn.Config(
        create_app(ctx),
        host=options.host,
        port=options.port,
        http="zttp",
        http2=True,
        loop="uvloop",
        lifespan="on",
        ssl_certfile=options.tls_cert,
        ssl_keyfile=options.tls_key,
        access_log=False,
        log_level="warning",
        timeout_graceful_shutdown=int(options.drain_seconds),
    )


def _announce(options: ServeOptions, ctx: ServingContext) -> None:
    scheme = "https" if options.tls_cert else "http"
    base = f"{scheme}://{options.host}:{options.port}"
    grpc = f", gRPC on {options.host}:{options.grpc_port}" if options.grpc_port else ""
    print(f"zerohop: serving '{ctx.model_name}' on {base} (HTTP/1.1 and HTTP/2){grpc}", flush=True)
    print(
        f"  try: curl {base}/v1/messages -H 'content-type: application/json' "
        f"""-d '{{"model": "{ctx.model_name}", "max_tokens": 32, "temperature": 0, """
        """"messages": [{"role": "user", "content": "What is the capital of France?"}]}'""",
        flush=True,
    )
