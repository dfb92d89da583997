"""`zerohop serve`: the engine process, the HTTP server (HTTP/1.1, h2c, TLS+ALPN h2 on one
port) and the gRPC server, started in that order and drained in reverse on SIGTERM.

Port 0 binds any free port; once both servers listen, the ports they bound are announced on
stdout and, with `port_file`, written to that file as JSON (`{"http": PORT, "grpc": PORT}`,
`"grpc": null` without a gRPC server)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import uvicorn

from zerohop.api.http.asgi import BodyDeadline
from zerohop.api.http.error_record import recording_app
from zerohop.api.http.guard import (
    ConnectionGuard,
    GuardLimits,
    GuardMetrics,
    guarded_protocol,
    raise_file_limit,
)
from zerohop.api.http.keepalive import DEFAULT_OPENAI_PING_INTERVAL, DEFAULT_PING_INTERVAL
from zerohop.api.load.overload import DEFAULT_MAX_QUEUE_WAIT, DEFAULT_MAX_WAITING, AdmissionControl
from zerohop.api.model_names import ModelNames
from zerohop.api.service import DEFAULT_MAX_BODY_BYTES, ServingContext
from zerohop.app import create_app
from zerohop.engine.client import EngineStarter
from zerohop.engine.loading.checkpoint import open_checkpoint
from zerohop.engine.process.async_engine import AsyncEngine
from zerohop.engine.process.supervisor import EngineSupervisor, RestartPolicy
from zerohop.gateway.fleet_options import LeaseOptions, SnapshotOptions
from zerohop.gateway.gateway import Gateway, GatewayStartError
from zerohop.gateway.server_keys import DEFAULT_ROTATION
from zerohop.gateway.store.key_snapshot import FILE_NAME, LocalCopy, read_or_load
from zerohop.gateway.store.open_store import StoreSpec, open_store
from zerohop.gateway.store.sqlite import default_db_path

log = logging.getLogger("zerohop")
# Seconds /health answers 503 after the supervisor gives up on the engine, before the server
# exits 1: long enough for a probe or a load balancer to see the failure, not the exit alone.
GIVE_UP_LINGER = 2.0


@dataclass(slots=True)
class ServeOptions:
    model_path: Path  # a Hugging Face folder or a GGUF file
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port
    grpc_port: int | None = 50051  # 0: any free port; None: no gRPC server
    port_file: Path | None = None  # once listening: {"http": PORT, "grpc": PORT | null}
    tls_cert: str | None = None
    tls_key: str | None = None
    # Peers whose X-Forwarded-Proto/-For uvicorn trusts (IPs, CIDR networks, or "*").
    forwarded_allow_ips: str = "127.0.0.1,::1"
    secure_cookies: bool = False  # the console's cookie Secure even on a plain-HTTP request
    served_model_name: list[str] | None = None  # concrete names or globs (model_names.py)
    model_aliases: list[str] | None = None  # None: any name, unless served_model_name is set
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    drain_seconds: float = 30.0
    engine: str = "zerohop"  # or "vllm": vLLM's AsyncLLM (zerohop.engine.vllm)
    engine_options: dict[str, Any] | None = None
    gateway: GatewayOptions = field(default_factory=lambda: GatewayOptions())
    guard: GuardLimits = field(default_factory=GuardLimits)
    keep_alive_timeout: float = 5.0
    grpc_max_concurrent_streams: int = 100
    body_deadline: BodyDeadline = field(default_factory=BodyDeadline)
    max_header_bytes: int = 32 * 1024
    ping_interval: float = DEFAULT_PING_INTERVAL  # seconds of silence before a stream's ping
    openai_ping_interval: float = DEFAULT_OPENAI_PING_INTERVAL  # on Chat and Completions
    max_queue_wait: float = DEFAULT_MAX_QUEUE_WAIT  # seconds; 0: no limit
    max_waiting: int = DEFAULT_MAX_WAITING  # 0: no limit
    engine_restarts: RestartPolicy = field(default_factory=RestartPolicy)
    tool_call_parser: str = "auto"  # hermes, llama3_json, mistral; auto: by chat template
    # Thinking blocks whose signature does not verify: refused (400), not left out.
    strict_thought_signatures: bool = False
    signing_key_rotation: float = DEFAULT_ROTATION  # seconds (gateway/server_keys.py)
    batches: BatchOptions = field(default_factory=lambda: BatchOptions())


@dataclass(slots=True)
class BatchOptions:
    enabled: bool = True
    db: Path | None = None  # None: batches.db beside the keys database
    max_share: float = 0.5  # of max_num_seqs that batch lines may hold at once
    max_bytes: int | None = None  # a batch create body or upload; None: each API's limit


@dataclass(slots=True)
class GatewayOptions:
    enabled: bool = True  # False: no keys, limits, budgets, audit or metrics (benchmarks)
    keys_db: Path | None = None  # None: $XDG_DATA_HOME/zerohop/keys.db
    # A PostgreSQL URL: the fleet's keys come from there, and keys_db is this replica's own
    # file (audit chain heads, budget ledger, batches.db beside it).
    store: str | None = None
    jwt_public_key: Path | None = None
    jwt_audience: str = "zerohop"
    revoked: Path | None = None
    allow_nonexpiring_signed_keys: bool = False  # accept signed keys without `exp`
    allow_anonymous: bool = False
    audit_dir: Path | None = None  # None: next to the keys database, in audit/
    audit: bool = True
    audit_content: bool = False
    audit_max_bytes: int = 64 * 2**20
    audit_failure: Literal["open", "closed"] = "open"  # while the audit log cannot be written
    audit_max_pending: int = 10_000  # audit records kept for retry meanwhile
    metrics: bool = True
    metrics_key: str | None = None
    durability: Literal["normal", "full"] = "full"  # the budget ledger (see sqlite_writer)
    ledger_failure: str = "open"  # unbudgeted requests while the ledger fails: open/closed
    leases: LeaseOptions = field(default_factory=LeaseOptions)  # with a PostgreSQL store
    snapshot: SnapshotOptions = field(default_factory=SnapshotOptions)  # the same


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

    async def startup(self, sockets: list | None = None) -> None:
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
    if gateway is not None:
        from zerohop.admin.attach import LiveSampler, attach_operator

        secure = options.secure_cookies or options.tls_cert is not None
        ctx.admin = attach_operator(gateway, secure_cookies=secure)
        sampler = LiveSampler(ctx.admin, lambda: engine.latest_stats)
    ctx.threads = open_threads(gateway)
    ctx.responses = open_responses(gateway)
    ctx.thoughts = open_thought_signatures(options, gateway)
    if options.batches.max_bytes is not None:
        ctx.max_batch_bytes = ctx.max_file_bytes = options.batches.max_bytes
    try:
        ctx.batches = open_batches(options, engine, gateway)
    except Exception:
        await engine.shutdown()
        raise
    if ctx.admin is not None and ctx.batches is not None:
        ctx.admin.batches = ctx.batches.store
    app = create_app(ctx)
    if ctx.batches is not None:
        ctx.batches.run_line = app.run_line  # type: ignore[attr-defined]
    config = _uvicorn_config(options, app)
    config.load()
    guard = ConnectionGuard(options.guard)
    config.http_protocol_class = guarded_protocol(guard)  # caps and head deadline
    if gateway is not None and gateway.metrics is not None:
        from zerohop.gateway.metrics import EngineRestartMetrics

        gateway.metrics.register(GuardMetrics(guard))  # its counters in GET /metrics
        gateway.metrics.register(EngineRestartMetrics(lambda: engine.restarts))
        if gateway.audit is not None:
            from zerohop.gateway.audit.metrics import AuditMetrics

            gateway.metrics.register(AuditMetrics(gateway.audit))
        if ctx.batches is not None:
            from zerohop.batches.metrics import BatchMetrics

            gateway.metrics.register(BatchMetrics(ctx.batches))
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
        if ctx.batches is not None:
            ctx.batches.start()
        await server.serve()
    finally:
        ctx.draining = True
        if ctx.batches is not None:  # its running lines go back to waiting
            await ctx.batches.stop()
            ctx.batches.store.close()
        await asyncio.to_thread(ctx.threads.close)
        await asyncio.to_thread(ctx.responses.close)
        await asyncio.to_thread(ctx.thoughts.close)
        if grpc_server is not None:
            await grpc_server.finish()
        await engine.shutdown()
        if sampler is not None:
            await sampler.stop()
        if gateway is not None:
            await gateway.close()  # after the streams: their audit records are flushed too
        server.release_signals()
    if engine.gave_up is not None:  # the orchestrator restarts the pod on a non-zero exit
        print(f"zerohop serve: exiting: {engine.gave_up}", file=sys.stderr, flush=True)
        return 1
    return 0


def open_threads(gateway: Gateway | None) -> Any:
    """The Anthropic surface's message threads, in the key store (opened on first use)."""
    from zerohop.api.anthropic.threads import Threads

    return Threads(_store_opener(gateway))


def open_responses(gateway: Gateway | None) -> Any:
    """The Responses API's stored responses, in the key store (opened on first use)."""
    from zerohop.api.responses.stored import StoredResponses

    return StoredResponses(_store_opener(gateway))


def open_thought_signatures(options: ServeOptions, gateway: Gateway | None) -> Any:
    """Thinking blocks' signing: the key store's keys (opened on first use), or the
    operator's ZEROHOP_REASONING_SECRET when set."""
    from zerohop.api.conversation.thought_signatures import (
        PURPOSE,
        SECRET_ENV,
        ThoughtSignatures,
    )
    from zerohop.gateway.server_keys import ServerKeys

    secret = os.environ.get(SECRET_ENV, "").encode() or None
    keys = ServerKeys(
        _store_opener(gateway),
        PURPOSE,
        rotation=options.signing_key_rotation,
        operator_secret=secret,
    )
    return ThoughtSignatures(keys, strict=options.strict_thought_signatures)


def _store_opener(gateway: Gateway | None) -> Callable[[], Any]:
    """Opens the key store; a server without a gateway has none, and keeps what it would
    store in memory for its lifetime."""
    from zerohop.gateway.store.sqlite import KeyStore

    if gateway is None:
        return lambda: KeyStore(Path(":memory:"))
    spec = gateway.auth.spec
    return lambda: open_store(spec)


def open_batches(options: ServeOptions, engine: EngineSupervisor, gateway: Gateway | None):
    """The batch store (recovering what a crash left running) and its runner, or None."""
    b = options.batches
    if not b.enabled:
        return None
    from zerohop.batches.runner import BatchRunner
    from zerohop.gateway.keys.identity import ANONYMOUS

    store = _batch_store(options, gateway)
    if store.recovered:
        log.info("batches: %d lines left running by the last process run again", store.recovered)
    identity_for = _model_identity(gateway) if gateway is not None else lambda _, __: ANONYMOUS
    from zerohop.engine.config import EngineConfig

    engine_options = options.engine_options or {}
    defaults = EngineConfig()
    max_num_seqs = engine_options.get("max_num_seqs") or defaults.max_num_seqs
    target = engine_options.get("inter_token_target", defaults.inter_token_target)
    return BatchRunner(store, engine, identity_for, int(b.max_share * max_num_seqs), target)


def _batch_store(options: ServeOptions, gateway: Gateway | None):
    """The fleet store's batch tables when the keys are the fleet's (every replica serves
    every batch), else this server's own SQLite file."""
    from zerohop.batches.store import BatchStore

    if gateway is not None and gateway.auth.spec.kind == "postgresql":
        from zerohop.batches.pg_store import PgBatchStore
        from zerohop.gateway.budgets.lease_keeper import LeaseKeeper, new_replica_id

        keeper = getattr(gateway.ledger, "keeper", None)
        owner = keeper.replica_id if isinstance(keeper, LeaseKeeper) else None
        url = gateway.auth.spec.url
        return PgBatchStore(url, owner or new_replica_id(), options.gateway.leases.ttl)
    keys_db = options.gateway.keys_db or default_db_path()
    return BatchStore(options.batches.db or keys_db.parent / "batches.db")


def _model_identity(gateway: Gateway):
    """A batch line's key as the store has it now (a signed key: as its batch's snapshot
    may serve now), None once it may not call the model."""
    from zerohop.gateway.keys.identity_snapshot import signed_identity_now

    def identity_for(key_id: str, snapshot: dict | None):
        if snapshot is not None:
            verifier = gateway.auth.verifier
            if verifier is not None:
                verifier.reload_revoked()
            return signed_identity_now(snapshot, None if verifier is None else verifier.revoked)
        identity = gateway.auth.identity_for(key_id)
        return identity if identity is not None and identity.inference else None

    return identity_for


def build_gateway(options: ServeOptions, model_name: str, block_size: int | None) -> Gateway:
    from zerohop.gateway.audit.heads import HeadStore
    from zerohop.gateway.audit.log import AuditLog
    from zerohop.gateway.metrics import GatewayMetrics

    g = options.gateway
    keys_db = g.keys_db or default_db_path()
    verifier = None
    if g.jwt_public_key is not None:
        from zerohop.gateway.keys.signed_tokens import SignedKeyVerifier

        verifier = SignedKeyVerifier(
            g.jwt_public_key,
            audience=g.jwt_audience,
            revoked_file=g.revoked,
            allow_nonexpiring=g.allow_nonexpiring_signed_keys,
        )
    audit = None
    if g.audit:
        audit = AuditLog(
            g.audit_dir or keys_db.parent / "audit",
            max_bytes=g.audit_max_bytes,
            include_content=g.audit_content,
            heads=HeadStore(keys_db),  # the chain head, outside the log's directory
            failure=g.audit_failure,
            max_pending=g.audit_max_pending,
        )
    metrics = GatewayMetrics(model_name, block_size=block_size) if g.metrics else None
    gateway = Gateway.from_store(
        store_spec(g),
        verifier,
        g.durability,
        local_db=keys_db,
        leases=g.leases,
        local_copy=local_copy(g),
        audit=audit,
        metrics=metrics,
        ledger_failure=g.ledger_failure,
    )
    gateway.start()
    return gateway


def check_open_mode(options: ServeOptions) -> None:
    """Without keys the server is open: only on loopback, unless --allow-anonymous. A
    PostgreSQL store is read here in any case: one that is not migrated, or cannot be
    reached while no local snapshot of its keys can stand in for it, refuses the start at
    once (StoreUnavailable), before the model loads."""
    g, host = options.gateway, options.host
    spec = store_spec(g)
    has_keys = _fleet_has_keys(g) if g.enabled and spec.kind == "postgresql" else None
    if g.allow_anonymous or is_loopback(host):
        return
    if not g.enabled:
        raise GatewayStartError(
            f"--no-gateway serves without keys, and {host} is not a loopback address:"
            " pass --allow-anonymous to serve it anyway"
        )
    if g.jwt_public_key is not None or (has_keys if has_keys is not None else _has_keys(spec)):
        return
    raise GatewayStartError(
        f"no API keys configured ({spec.describe()} has none and no --jwt-public-key) and"
        f" {host} is not a loopback address: create one with `zerohop keys create --tenant"
        " NAME`, or pass --allow-anonymous to serve without keys"
    )


def store_spec(g: GatewayOptions) -> StoreSpec:
    """Where the keys are: --store, else the --keys-db file."""
    return StoreSpec.parse(g.store) if g.store else StoreSpec.sqlite(g.keys_db or default_db_path())


def local_copy(g: GatewayOptions) -> LocalCopy | None:
    """The local snapshot of a fleet store's keys (--store-snapshot, else beside
    --keys-db); None without a fleet store."""
    spec = store_spec(g)
    if spec.kind != "postgresql":
        return None
    path = g.snapshot.path or (g.keys_db or default_db_path()).parent / FILE_NAME
    return LocalCopy(path, spec.describe(), g.snapshot.max_age)


def _fleet_has_keys(g: GatewayOptions) -> bool:
    """Whether the fleet store has keys; while it cannot be reached, whether the local
    snapshot has (StoreUnavailable, in one line, when neither can be read)."""
    from zerohop.gateway.store.pg_key_feed import read_now

    url = store_spec(g).url
    return read_or_load(lambda: read_now(url), local_copy(g), announce=False).has_keys


def _has_keys(spec: StoreSpec) -> bool:
    if spec.kind == "sqlite" and not spec.path.is_file():
        return False  # not created here: `zerohop keys create` does
    store = open_store(spec)
    try:
        return store.has_keys()
    finally:
        store.close()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
