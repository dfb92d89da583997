"""`zerohop serve`: the engine process, the HTTP server (HTTP/1.1, h2c, TLS+ALPN h2 on one
port) and the gRPC server, started in that order and drained in reverse on SIGTERM.

Port 0 binds any free port; once both servers listen, the ports they bound are announced on
stdout and, with `port_file`, written to that file as JSON (`{"http": PORT, "grpc": PORT}`,
`"grpc": null` without a gRPC server)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import uvicorn

from zerohop.api.http.error_record import recording_app
from zerohop.api.http.guard import (
    ConnectionGuard,
    GuardMetrics,
    guarded_protocol,
    raise_file_limit,
)
from zerohop.api.http.trusted_front import TrustedFront
from zerohop.api.http.websocket import DrainingWebSocket
from zerohop.api.load.overload import AdmissionControl
from zerohop.api.responses.socket_metrics import SocketMetrics
from zerohop.api.serving.model_names import ModelNames
from zerohop.api.serving.service import ServingContext
from zerohop.app.gateway_start import build_gateway, check_open_mode
from zerohop.app.options import BatchOptions, GatewayOptions, ServeOptions
from zerohop.app.routes import create_app
from zerohop.app.services import Services
from zerohop.app.stores import (
    open_batches,
    open_responses,
    open_thought_signatures,
    open_threads,
    process_store,
)
from zerohop.engine.client import EngineStarter
from zerohop.engine.loading.checkpoint import open_checkpoint
from zerohop.engine.process.async_engine import AsyncEngine
from zerohop.engine.process.supervisor import EngineSupervisor
from zerohop.gateway.gateway import GatewayStartError

__all__ = ["BatchOptions", "GatewayOptions", "ServeOptions", "check_open_mode", "serve"]

log = logging.getLogger("zerohop")
# Seconds /health answers 503 after the supervisor gives up on the engine, before the server
# exits 1: long enough for a probe or a load balancer to see the failure, not the exit alone.
GIVE_UP_LINGER = 2.0


class DrainingServer(uvicorn.Server):
    """uvicorn, but SIGTERM/SIGINT mark the server not-ready, drain, and exit 0.

    (uvicorn's own handlers re-raise the signal after shutdown, which exits non-zero.)
    """

    def __init__(
        self,
        config: uvicorn.Config,
        ctx: ServingContext,
        on_listening: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__(config)
        self.ctx = ctx
        self.on_listening = on_listening  # called with the bound HTTP port once listening
        self.on_drain: list[Callable[[bool], None]] = []  # each signal: hook(second signal?)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.on_listening is not None:
            # As uvicorn reports it for port 0: the first listening socket's port.
            self.on_listening(self.servers[0].sockets[0].getsockname()[1])

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # Installed for uvicorn's serve() and kept past it: the rest of the drain (gRPC
        # streams, batches, the engine) runs after HTTP has stopped, and a second signal
        # then must still cut it short rather than kill the process (`release_signals`).
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.begin_drain)
        yield

    @staticmethod
    def release_signals() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)

    def begin_drain(self) -> None:
        again = self.ctx.draining
        if again:
            self.force_exit = True  # a second signal: stop waiting
        self.ctx.draining = True
        self.should_exit = True
        for hook in self.on_drain:
            hook(again)


def engine_starter(engine: str) -> EngineStarter:
    """How a life of the chosen engine starts (vLLM is imported only when it serves)."""
    if engine == "vllm":
        from zerohop.engine.vllm.engine import VllmEngine

        return VllmEngine.start
    return AsyncEngine.start


async def serve(options: ServeOptions) -> int:
    check_open_mode(options)  # before loading anything: a refusal comes at once
    if (warning := raise_file_limit(options.guard)) is not None:
        raise GatewayStartError(warning)
    engine_options = options.engine_options or {}
    # The engine process loads the weights while this one builds the tokenizer.
    starting = asyncio.create_task(
        EngineSupervisor.start(
            str(options.model_path),
            options.engine_restarts,
            engine_starter(options.engine),
            **engine_options,
        )
    )
    try:
        checkpoint = await asyncio.to_thread(open_checkpoint, options.model_path)
        tokenizer = await asyncio.to_thread(checkpoint.tokenizer)
    except BaseException:
        with contextlib.suppress(Exception):
            await (await starting).shutdown()
        raise
    engine = await starting
    names = ModelNames.from_flags(checkpoint.name, options.served_model_name, options.model_aliases)
    model_name = names.primary
    gateway = None
    if options.gateway.enabled:
        try:
            gateway = build_gateway(options, model_name, engine.info.get("block_size"))
            if gateway.audit is not None:
                gateway.audit.start()
        except Exception:
            await engine.shutdown()
            raise
    ctx = ServingContext(
        engine=engine,
        tokenizer=tokenizer,
        model_name=model_name,
        names=names,
        max_model_len=engine.info["max_model_len"],
        max_body_bytes=options.max_body_bytes,
        gateway=gateway,
        metrics_token=options.gateway.metrics_key,
        body_deadline=options.body_deadline,
        max_header_bytes=options.max_header_bytes,
        trusted_front=TrustedFront.parse(options.trusted_front),
        ping_interval=options.ping_interval,
        openai_ping_interval=options.openai_ping_interval,
        tool_call_parser=options.tool_call_parser,
        admission=AdmissionControl(
            engine,
            options.max_queue_wait,
            options.max_waiting,
            fair_share=(options.engine_options or {}).get("scheduling_policy", "vtc") == "vtc",
        ),
    )
    sampler = None
    services = Services()
    if gateway is not None:
        from zerohop.admin.attach import LiveSampler, attach_operator

        secure = options.secure_cookies or options.tls_cert is not None
        services.admin = attach_operator(gateway, secure_cookies=secure)
        sampler = LiveSampler(services.admin, lambda: engine.latest_stats)
    store = process_store(gateway)  # opened on first use, closed once below
    services.threads = open_threads(store)
    services.responses = responses = open_responses(store, gateway, options.gateway.leases.ttl)
    ctx.thoughts = open_thought_signatures(options, store)
    if options.batches.max_bytes is not None:
        ctx.max_batch_bytes = ctx.max_file_bytes = options.batches.max_bytes
    try:
        services.batches = batches = open_batches(options, engine, gateway, store)
    except Exception:
        await engine.shutdown()
        raise
    if services.admin is not None and batches is not None:
        services.admin.batches = batches.store
    app = create_app(ctx, services, options.socket_limits)
    if batches is not None:
        batches.run_line = app.run_line  # type: ignore[attr-defined]
    config = _uvicorn_config(options, app)
    config.load()
    guard = ConnectionGuard(options.guard)
    config.http_protocol_class = guarded_protocol(guard)  # caps and head deadline
    if gateway is not None and gateway.metrics is not None:
        from zerohop.gateway.metrics import EngineRestartMetrics

        gateway.metrics.register(GuardMetrics(guard))  # its counters in GET /metrics
        gateway.metrics.register(SocketMetrics(app.socket))  # type: ignore[attr-defined]
        gateway.metrics.register(EngineRestartMetrics(lambda: engine.restarts))
        if gateway.audit is not None:
            from zerohop.gateway.audit.metrics import AuditMetrics

            gateway.metrics.register(AuditMetrics(gateway.audit))
        if batches is not None:
            from zerohop.batches.metrics import BatchMetrics

            gateway.metrics.register(BatchMetrics(batches))
    grpc_server = grpc_port = None

    def listening(http_port: int) -> None:
        _announce(options, ctx, http_port, grpc_port)
        if options.port_file is not None:
            write_port_file(options.port_file, http_port, grpc_port)

    server = DrainingServer(config, ctx, on_listening=listening)

    def exit_after_failing_health(_: str) -> None:  # then exit 1
        loop = asyncio.get_running_loop()
        loop.call_later(GIVE_UP_LINGER, setattr, server, "should_exit", True)

    engine.on_give_up = exit_after_failing_health
    server.should_exit = engine.gave_up is not None
    try:
        if options.grpc_port is not None:
            from zerohop.api.grpc.service import GrpcDrain, start_grpc_server

            started, grpc_port = await start_grpc_server(
                ctx, options.host, options.grpc_port, options.grpc_max_concurrent_streams
            )
            grpc_server = GrpcDrain(started, options.drain_seconds)
            server.on_drain.append(grpc_server.begin)  # beside HTTP's drain, as long
        if gateway is not None:
            gateway.start_watching()
        if sampler is not None:
            sampler.start()
        if batches is not None:
            batches.start()
        sqlite = gateway is None or gateway.auth.spec.kind != "postgresql"
        await responses.leases.start(recover=sqlite)  # one server per SQLite file
        await server.serve()
    finally:
        ctx.draining = True
        await responses.leases.stop()
        if batches is not None:  # its running lines go back to waiting (closed with the store)
            await batches.stop()
        if grpc_server is not None:
            await grpc_server.finish()
        await engine.shutdown()
        if sampler is not None:
            await sampler.stop()
        if gateway is not None:
            await gateway.close()  # after the streams: their audit records are flushed too
        await asyncio.to_thread(store.close)  # the gateway's is closed already: no-op then
        server.release_signals()
    if engine.gave_up is not None:  # the orchestrator restarts the pod on a non-zero exit
        print(f"zerohop serve: exiting: {engine.gave_up}", file=sys.stderr, flush=True)
        return 1
    return 0


def _uvicorn_config(options: ServeOptions, app: Any) -> uvicorn.Config:
    return uvicorn.Config(
        recording_app(app),  # as it is, unless ZEROHOP_ERROR_RECORD is set
        host=options.host,
        port=options.port,
        http="zttp",
        http2=True,
        loop="uvloop",
        lifespan="on",
        ssl_certfile=options.tls_cert,
        ssl_keyfile=options.tls_key,
        forwarded_allow_ips=options.forwarded_allow_ips,
        access_log=False,
        log_level="warning",
        server_header=False,
        headers=[("server", "zerohop")],
        timeout_keep_alive=options.keep_alive_timeout,  # type: ignore[arg-type]  # uvicorn takes fractions
        timeout_graceful_shutdown=int(options.drain_seconds),
        # WebSocket mode on /v1/responses: a message may be as large as an HTTP body; the
        # protocol closes the socket when the application drains (api/http/websocket.py).
        ws=DrainingWebSocket,
        ws_max_size=options.max_body_bytes,
    )


def write_port_file(path: Path, http_port: int, grpc_port: int | None) -> None:
    """The bound ports as JSON, replaced in one step: a reader never sees half a file."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(json.dumps({"http": http_port, "grpc": grpc_port}) + "\n")
    os.replace(partial, path)


def _announce(
    options: ServeOptions, ctx: ServingContext, http_port: int, grpc_port: int | None
) -> None:
    scheme = "https" if options.tls_cert else "http"
    base = f"{scheme}://{options.host}:{http_port}"
    grpc = f", gRPC on {options.host}:{grpc_port}" if grpc_port is not None else ""
    print(f"zerohop: serving '{ctx.model_name}' on {base} (HTTP/1.1 and HTTP/2){grpc}", flush=True)
    print(f"  {_names_line(ctx.names)}", flush=True)
    gateway = ctx.gateway
    if gateway is not None and not gateway.auth.keys_configured:
        print(
            f"  no API keys configured: open to any client that can reach {options.host}"
            f" ({gateway.auth.describe()}; `zerohop keys create --tenant NAME` adds one)",
            flush=True,
        )
    print(
        f"  try: curl {base}/v1/messages -H 'content-type: application/json' "
        f"""-d '{{"model": "{ctx.model_name}", "max_tokens": 32, "temperature": 0, """
        """"messages": [{"role": "user", "content": "What is the capital of France?"}]}'""",
        flush=True,
    )


def _names_line(names: ModelNames) -> str:
    """What the banner says of the names requests may use."""
    if names.any_name:
        return "model names: any name is accepted (--served-model-name/--model-alias restrict)"
    others = [*names.served[1:], *names.aliases]
    return f"model names: also {', '.join(others)}" if others else "model names: only this one"
