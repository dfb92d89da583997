"""`zerohop serve`: its parser (engine, supervision, protection and gateway flags) and the
command, which builds the options `zerohop.server.serve` runs with."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from zerohop.cli.arg_types import (
    NONNEGATIVE_INT,
    NONNEGATIVE_NUMBER,
    PORT,
    POSITIVE_INT,
    POSITIVE_NUMBER,
    SHARE,
    TOOL_CALL_PARSERS,
    integer,
    number,
)
from zerohop.cli.engine_choice import (
    add_vllm_options,
    check_engine_flags,
    chosen_engine,
    vllm_arguments,
)
from zerohop.cli.engine_flags import (
    MODEL_HELP,
    add_engine_options,
    default_engine_threads,
    engine_options,
    resolve_model,
)


def cmd_serve(args: argparse.Namespace) -> int:
    """`zerohop serve`: the arguments as `ServeOptions`, served until SIGTERM/SIGINT."""
    import logging

    from zerohop.api.http.asgi import BodyDeadline
    from zerohop.api.http.guard import GuardLimits
    from zerohop.engine.process.supervisor import RestartPolicy
    from zerohop.gateway.fleet_options import LeaseOptions, SnapshotOptions
    from zerohop.gateway.store.spec import store_text
    from zerohop.server import BatchOptions, GatewayOptions, ServeOptions, serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    engine = chosen_engine(args.engine)
    refusal = check_engine_flags(engine, args, _serve_defaults())
    if refusal is not None:
        raise SystemExit(f"zerohop serve: {refusal}")
    options = engine_options(args)
    if engine == "vllm":
        options["vllm_args"] = vllm_arguments(args)
        # Flags left at zerohop's defaults take vLLM's own (a vLLM user expects those: its
        # CPU build, for one, needs blocks of a multiple of 32 tokens).
        defaults = _serve_defaults()
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(args, name) == defaults[name]:
                options.pop(name)
    else:
        options["num_threads"] = options["num_threads"] or default_engine_threads()
    serve_options = ServeOptions(
        model_path=resolve_model(args.model),
        host=args.host,
        port=args.port,
        grpc_port=args.grpc_port,
        port_file=args.port_file,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        forwarded_allow_ips=args.forwarded_allow_ips,
        secure_cookies=args.secure_cookies,
        served_model_name=args.served_model_name,
        model_aliases=args.model_alias,
        max_body_bytes=args.max_body_bytes,
        drain_seconds=args.drain_seconds,
        engine=engine,
        engine_options=options,
        guard=GuardLimits(
            max_connections=args.max_connections,
            max_connections_per_address=args.max_connections_per_address,
            header_timeout=args.header_timeout,
            http2_max_streams=args.http2_max_streams,
        ),
        keep_alive_timeout=args.keep_alive_timeout,
        grpc_max_concurrent_streams=args.grpc_max_concurrent_streams,
        body_deadline=BodyDeadline(args.body_timeout, args.body_min_rate),
        max_queue_wait=args.max_queue_wait,
        max_waiting=args.max_waiting,
        engine_restarts=RestartPolicy(
            args.engine_max_restarts, args.engine_restart_window, args.engine_start_timeout
        ),
        max_header_bytes=args.max_header_bytes,
        ping_interval=args.stream_ping_interval,
        openai_ping_interval=args.openai_ping_interval,
        tool_call_parser=args.tool_call_parser,
        strict_thought_signatures=args.strict_thought_signatures,
        signing_key_rotation=args.signing_key_rotation,
        batches=BatchOptions(
            enabled=not args.no_batches,
            db=args.batches_db,
            max_share=args.batch_max_share,
            max_bytes=args.max_batch_bytes,
        ),
        gateway=GatewayOptions(
            enabled=not args.no_gateway,
            keys_db=args.keys_db,
            store=store_text(args.store),
            jwt_public_key=args.jwt_public_key,
            jwt_audience=args.jwt_audience,
            revoked=args.revoked,
            allow_nonexpiring_signed_keys=args.allow_nonexpiring_signed_keys,
            allow_anonymous=args.allow_anonymous,
            audit_dir=args.audit_dir,
            audit=not args.no_audit,
            audit_content=args.audit_content,
            audit_max_bytes=args.audit_max_bytes,
            audit_failure=args.audit_failure,
            audit_max_pending=args.audit_max_pending,
            metrics=not args.no_metrics,
            metrics_key=args.metrics_key or os.environ.get("ZEROHOP_METRICS_KEY"),
            durability=args.durability,
            ledger_failure=args.ledger_failure,
            leases=LeaseOptions(args.lease_ttl, args.lease_wait, args.lease_horizon),
            snapshot=SnapshotOptions(args.store_snapshot, args.store_snapshot_max_age),
        ),
    )
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("zerohop serve: --tls-cert and --tls-key go together")
    if args.secure_cookies and args.no_gateway:
        console = "the console, which --no-gateway turns off"
        raise SystemExit(f"zerohop serve: --secure-cookies is for {console}")
    try:
        import uvloop

        return uvloop.run(serve(serve_options))
    except ImportError:
        return asyncio.run(serve(serve_options))


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    srv = sub.add_parser(
        "serve",
        help="serve a model over HTTP (Anthropic + OpenAI APIs) and gRPC",
        description="Serve MODEL (a GGUF file, a Hugging Face folder or 'tiny'), or the default"
        " model, over HTTP (Anthropic + OpenAI APIs) and gRPC, with the gateway (keys, limits,"
        " budgets, audit, metrics) built in.",
    )
    srv.add_argument("model", nargs="?", metavar="MODEL", help=MODEL_HELP)
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    srv.add_argument(
        "--port",
        type=PORT,
        default=8000,
        help="HTTP port: HTTP/1.1, h2c and TLS+ALPN h2 (0: any free port, see --port-file)",
    )
    srv.add_argument(
        "--grpc-port",
        type=_grpc_port,
        default=50051,
        help="gRPC port (0: no gRPC server; auto: any free port, see --port-file)",
    )
    srv.add_argument(
        "--port-file",
        type=Path,
        help='once listening, write the ports bound to this file as JSON: {"http": PORT,'
        ' "grpc": PORT} ("grpc": null without a gRPC server)',
    )
    srv.add_argument("--tls-cert", help="PEM certificate: serve HTTPS (h2 or http/1.1 by ALPN)")
    srv.add_argument("--tls-key", help="PEM private key of --tls-cert")
    srv.add_argument(
        "--forwarded-allow-ips",
        type=_forwarded_allow_ips,
        default="127.0.0.1,::1",
        metavar="ADDRESSES",
        help="comma-separated IP addresses or CIDR networks (or *: any peer) of the proxies"
        " whose X-Forwarded-Proto and X-Forwarded-For are believed: a request they forward"
        " with X-Forwarded-Proto: https counts as HTTPS (the console cookie is Secure, the"
        " same-site check expects https) and the audit names the client they forwarded for"
        " (default: 127.0.0.1,::1)",
    )
    srv.add_argument(
        "--secure-cookies",
        action="store_true",
        help="mark the console's session cookie Secure on every answer, for a TLS-terminating"
        " proxy that sends no X-Forwarded-Proto (without it: Secure over --tls-cert, or when a"
        " proxy of --forwarded-allow-ips says https)",
    )
    srv.add_argument(
        "--served-model-name",
        action="extend",
        nargs="+",
        type=_model_name,
        metavar="NAME",
        help="the model names clients use, listed by GET /v1/models; the first is the primary"
        " (default: the folder's or file's name, without a quantization suffix); a name with"
        " a glob (*, ?, [...]) is an alias pattern. Responses echo the name a request used",
    )
    srv.add_argument(
        "--model-alias",
        action="extend",
        nargs="*",
        type=_model_name,
        metavar="PATTERN",
        help="more names requests may use, or fnmatch globs ('claude-*', 'gpt-5*'); concrete"
        " ones are listed too. With neither flag any name is accepted; naming the model with"
        " either accepts only the names given (--model-alias '*': any name again)",
    )
    srv.add_argument(
        "--max-body-bytes", type=POSITIVE_INT, default=32 * 2**20, help="larger bodies get 413"
    )
    srv.add_argument(
        "--drain-seconds",
        type=NONNEGATIVE_NUMBER,
        default=30.0,
        help="on SIGTERM, how long in-flight streams may finish before they are cancelled",
    )
    srv.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default="auto",
        help="the format the model writes tool calls in (auto: told from the chat template;"
        " forced calls are always Hermes)",
    )
    srv.add_argument(
        "--strict-thought-signatures",
        action="store_true",
        help="refuse (400) a thinking block sent back whose signature does not verify (an"
        " edited thought, another model or tenant, a key this deployment does not know or no"
        " longer keeps); by default such a block is left out of the prompt",
    )
    srv.add_argument(
        "--signing-key-rotation",
        type=number(60.0),
        default=7 * 86_400.0,  # zerohop.gateway.server_keys.DEFAULT_ROTATION
        metavar="SECONDS",
        help="make a new key for thinking blocks' signatures once the current one is this old"
        " (>= 60; default 7 days); a replaced key still verifies for as long again. Keys are"
        " in the key store (with --store, the fleet's); give every replica the same value."
        " ZEROHOP_REASONING_SECRET, when set, signs instead and never rotates",
    )
    add_supervision_options(srv)
    add_protection_options(srv)
    add_gateway_options(srv)
    add_engine_options(srv)
    add_vllm_options(srv)
    srv.set_defaults(func=cmd_serve)


def _serve_defaults() -> dict[str, object]:
    """Every flag's default, to tell which ones a command line set."""
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    return vars(parser.parse_args([]))


def add_supervision_options(parser: argparse.ArgumentParser) -> None:
    from zerohop.engine.process.async_engine import DEFAULT_START_TIMEOUT
    from zerohop.engine.process.supervisor import DEFAULT_MAX_RESTARTS, DEFAULT_RESTART_WINDOW

    g = parser.add_argument_group("engine supervision (a dead engine process is restarted)")
    g.add_argument(
        "--engine-max-restarts",
        type=NONNEGATIVE_INT,
        default=DEFAULT_MAX_RESTARTS,
        help="give up (fail /health, exit 1) past this many engine restarts within"
        " --engine-restart-window, or this many failed starts in a row (0: never restart)",
    )
    g.add_argument(
        "--engine-restart-window",
        type=POSITIVE_NUMBER,
        default=DEFAULT_RESTART_WINDOW,
        metavar="SECONDS",
        help="the window --engine-max-restarts counts restarts in",
    )
    g.add_argument(
        "--engine-start-timeout",
        type=POSITIVE_NUMBER,
        default=DEFAULT_START_TIMEOUT,
        metavar="SECONDS",
        help="an engine process not ready within this long is killed: a failed start (the"
        " first: the server exits 1; a restart: retried as --engine-max-restarts allows)",
    )


def _model_name(text: str) -> str:
    """A --served-model-name or --model-alias value (zerohop.api.model_names.check_name)."""
    from zerohop.api.model_names import check_name

    try:
        return check_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _forwarded_allow_ips(text: str) -> str:
    """A --forwarded-allow-ips value: "*", or IP addresses and CIDR networks, comma-separated
    (uvicorn would read a malformed entry as a name no peer has, and trust nobody silently)."""
    import ipaddress

    entries = [entry.strip() for entry in text.split(",")]
    if entries == ["*"]:
        return "*"
    for entry in entries:
        try:
            ipaddress.ip_network(entry) if "/" in entry else ipaddress.ip_address(entry)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{entry!r} is not an IP address or a CIDR network (such as 10.0.0.0/8);"
                " give a comma-separated list of them, or * for any peer"
            ) from None
    return ",".join(entries)


def _snapshot_file(text: str) -> Path:
    """A --store-snapshot value: a file's path (it need not exist yet), not a folder's."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path: name a file")
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder: name a file in it")
    if path.parent.exists() and not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{path.parent} is not a folder")
    return path


def _grpc_port(text: str) -> int | None:
    """ServeOptions.grpc_port: 'auto' -> 0 (any free port), '0' -> None (no gRPC server)."""
    if text == "auto":
        return 0
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("a port number, 0 (no gRPC server) or auto") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError("a port number, 0 (no gRPC server) or auto")
    return port or None


def add_protection_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("protection (what a reverse proxy used to do)")
    g.add_argument(
        "--max-queue-wait",
        type=NONNEGATIVE_NUMBER,
        default=30.0,
        help="refuse a request at once (Anthropic 529, OpenAI 503, gRPC UNAVAILABLE, with"
        " retry-after) when its estimated queue wait is longer, in seconds (0: never)",
    )
    g.add_argument(
        "--max-waiting",
        type=NONNEGATIVE_INT,
        default=512,
        help="refuse a request at once when this many are already waiting (0: no limit)",
    )
    g.add_argument(
        "--max-connections", type=POSITIVE_INT, default=4096, help="open HTTP connections at most"
    )
    g.add_argument(
        "--max-connections-per-address",
        type=POSITIVE_INT,
        default=256,
        help="open HTTP connections from one client address at most",
    )
    g.add_argument(
        "--header-timeout",
        type=POSITIVE_NUMBER,
        default=20.0,
        help="seconds a request head may take to arrive (else 408 and close)",
    )
    g.add_argument(
        "--body-timeout",
        type=POSITIVE_NUMBER,
        default=30.0,
        help="seconds a request body may take, plus 1 s per --body-min-rate bytes (else 408)",
    )
    g.add_argument(
        "--body-min-rate",
        type=POSITIVE_NUMBER,
        default=4096.0,
        help="bytes per second a body must keep",
    )
    g.add_argument(
        "--keep-alive-timeout",
        type=POSITIVE_NUMBER,
        default=5.0,
        help="idle seconds before closing",
    )
    g.add_argument(
        "--stream-ping-interval",
        type=POSITIVE_NUMBER,
        default=5.0,  # zerohop.api.http.keepalive.DEFAULT_PING_INTERVAL
        help="seconds a stream may stay silent (a long prefill) before a keep-alive ping",
    )
    g.add_argument(
        "--openai-ping-interval",
        type=POSITIVE_NUMBER,
        default=30.0,  # zerohop.api.http.keepalive.DEFAULT_OPENAI_PING_INTERVAL
        help="the same on OpenAI Chat and Completions streams, whose SSE comment ping the OpenAI"
        " API never sends and vLLM's bench serve misreads",
    )
    g.add_argument(
        "--max-header-bytes",
        type=POSITIVE_INT,
        default=32 * 1024,
        help="request headers larger than this get 431",
    )
    g.add_argument(
        "--http2-max-streams",
        type=integer(1, 128),
        default=128,
        metavar="1..128",
        help="concurrent streams on one HTTP/2 connection (more are refused); the HTTP/2"
        " layer advertises and enforces 128, so 128 is also the most",
    )
    g.add_argument(
        "--grpc-max-concurrent-streams",
        type=POSITIVE_INT,
        default=100,
        help="gRPC calls in flight on one connection at most (a call started as another ends"
        " may be refused with UNAVAILABLE: clients should retry it)",
    )


def add_gateway_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("gateway (keys, limits, budgets, audit, metrics)")
    g.add_argument(
        "--keys-db",
        type=Path,
        default=None,
        help="SQLite key store and budget ledger (default: $XDG_DATA_HOME/zerohop/keys.db);"
        " with --store, this replica's own file (budget ledger, audit chain heads)",
    )
    g.add_argument(
        "--store",
        help="a fleet's shared key store, postgresql://... (default: env ZEROHOP_STORE, where a"
        " password belongs: never on a command line); `zerohop store migrate` prepares it",
    )
    g.add_argument(
        "--lease-ttl",
        type=number(2.0),
        default=60.0,
        help="with --store: seconds a budget lease lives unrenewed (>= 2); a replica that stops"
        " renewing (killed, cut off) has its lease's unspent rest charged after this",
    )
    g.add_argument(
        "--lease-wait",
        type=NONNEGATIVE_NUMBER,
        default=0.25,
        help="with --store: seconds a request waits for its lease (budget or rate share) to be"
        " topped up before it is clamped or refused as retryable",
    )
    g.add_argument(
        "--lease-horizon",
        type=POSITIVE_NUMBER,
        default=10.0,
        help="with --store: a budget lease holds about this many seconds of recent spend",
    )
    g.add_argument(
        "--store-snapshot",
        type=_snapshot_file,
        metavar="FILE",
        help="with --store: the file this replica keeps the fleet's keys in (secret hashes,"
        " never secrets; mode 0600), rewritten whenever it reads them from the store, to start"
        " from while PostgreSQL is down (default: store-snapshot.json beside --keys-db)",
    )
    g.add_argument(
        "--store-snapshot-max-age",
        type=POSITIVE_NUMBER,
        default=24 * 3600.0,
        metavar="SECONDS",
        help="with --store: a replica started while PostgreSQL is down serves the keys of"
        " --store-snapshot only if they were read from the store at most this long ago"
        " (default: 86400, a day); otherwise it refuses to start",
    )
    g.add_argument(
        "--jwt-public-key", type=Path, help="PEM or JWKS file: accept keys signed by the operator"
    )
    g.add_argument("--jwt-audience", default="zerohop", help="the `aud` signed keys must carry")
    g.add_argument("--revoked", type=Path, help="file of revoked signed-key ids / jti, one a line")
    g.add_argument(
        "--allow-nonexpiring-signed-keys",
        action="store_true",
        help="accept signed keys without an expiry (exp); by default they are refused (401)",
    )
    g.add_argument(
        "--allow-anonymous",
        action="store_true",
        help="serve without keys on a non-loopback address (no keys configured)",
    )
    g.add_argument("--audit-dir", type=Path, help="audit log folder (default: beside --keys-db)")
    g.add_argument("--no-audit", action="store_true", help="write no audit log")
    g.add_argument("--audit-content", action="store_true", help="audit prompts and outputs too")
    g.add_argument(
        "--audit-max-bytes",
        type=POSITIVE_INT,
        default=64 * 2**20,
        help="rotate the audit file at this size",
    )
    g.add_argument(
        "--audit-failure",
        choices=("open", "closed"),
        default="open",
        help="while the audit log cannot be written (disk error, full disk): open (default)"
        " serves on and counts the records lost in /metrics; closed refuses new requests with"
        " 503 until a write succeeds again; /health stays up either way",
    )
    g.add_argument(
        "--audit-max-pending",
        type=POSITIVE_INT,
        default=10_000,
        help="audit records kept in memory for retry while the log cannot be written (more"
        " are lost and counted)",
    )
    g.add_argument("--no-metrics", action="store_true", help="no GET /metrics")
    g.add_argument(
        "--batches-db",
        type=Path,
        help="the Message Batches store (SQLite; result files beside it); default:"
        " batches.db beside the keys database",
    )
    g.add_argument(
        "--batch-max-share",
        type=SHARE,
        default=0.5,
        help="the share of --max-num-seqs that batch lines may hold at once (0 < share <= 1;"
        " they start only when no interactive request waits)",
    )
    g.add_argument(
        "--max-batch-bytes",
        type=POSITIVE_INT,
        help="largest Message Batches create body and batch file upload (larger get 413);"
        " default: the APIs' own limits, 256 MiB and 200 MiB",
    )
    g.add_argument(
        "--no-batches",
        action="store_true",
        help="no batch routes (/v1/messages/batches, /v1/files, /v1/batches)",
    )
    g.add_argument(
        "--no-gateway",
        action="store_true",
        help="no keys, limits, budgets, audit or metrics at all (to measure what they cost)",
    )
    g.add_argument(
        "--metrics-key", help="bearer token GET /metrics requires (env ZEROHOP_METRICS_KEY)"
    )
    g.add_argument(
        "--durability",
        choices=("normal", "full"),
        default="full",
        help="the budget ledger: full (default) fsyncs every group commit and survives power"
        " loss; normal survives a killed process, but an OS crash or power loss can lose the"
        " last reservations",
    )
    g.add_argument(
        "--ledger-failure",
        choices=("open", "closed"),
        default="open",
        help="requests without a token budget while the budget ledger cannot be written: open"
        " (default) serves them, closed refuses them too (budgeted ones are always refused)",
    )
