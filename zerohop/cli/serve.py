"""`zerohop serve`: its parser (its own flags, and the groups of engine_flags.py,
engine_choice.py and serve_flags.py) and the command, which builds the options
`zerohop.app.server.serve` runs with."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path
from typing import Literal

from zerohop.cli.arg_types import (
    NONNEGATIVE_NUMBER,
    PORT,
    POSITIVE_INT,
    POSITIVE_NUMBER,
    TOOL_CALL_PARSERS,
    Subcommands,
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
from zerohop.cli.serve_flags import (
    add_gateway_options,
    add_protection_options,
    add_supervision_options,
)

# The engine flags whose zerohop default gives way to vLLM's own under --engine vllm.
VllmDefault = Literal["block_size", "max_num_seqs", "max_num_batched_tokens"]


def cmd_serve(args: argparse.Namespace) -> int:
    """`zerohop serve`: the arguments as `ServeOptions`, served until SIGTERM/SIGINT."""
    import logging

    from zerohop.api.http.asgi import BodyDeadline
    from zerohop.api.http.guard import GuardLimits
    from zerohop.api.http.websocket import SocketLimits
    from zerohop.app.server import BatchOptions, GatewayOptions, ServeOptions, serve
    from zerohop.engine.process.supervisor import RestartPolicy
    from zerohop.gateway.fleet_options import LeaseOptions, SnapshotOptions
    from zerohop.gateway.store.spec import store_text

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
        names: tuple[VllmDefault, ...] = ("block_size", "max_num_seqs", "max_num_batched_tokens")
        for name in names:
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
        trusted_front=args.trusted_front,
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
        socket_limits=SocketLimits(args.ws_idle_seconds, args.ws_max_queued),
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


def add_serve_parser(sub: Subcommands) -> None:
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
        "--trusted-front",
        type=_trusted_front,
        default="",
        metavar="ADDRESSES",
        help="comma-separated IP addresses or CIDR networks of a trusted front (Anthropic's"
        " `claude gateway` with forward_user_identity, a LiteLLM proxy): from these peers only,"
        " x-claude-gateway-user-id / -user-email and x-litellm-end-user-id name the end user"
        " in the audit log and the admin API (default: none)",
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
    _add_websocket_options(srv)
    add_supervision_options(srv)
    add_protection_options(srv)
    add_gateway_options(srv)
    add_engine_options(srv)
    add_vllm_options(srv)
    srv.set_defaults(func=cmd_serve)


def _add_websocket_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("WebSocket mode (/v1/responses)")
    g.add_argument(
        "--ws-idle-seconds",
        type=POSITIVE_NUMBER,
        default=900.0,
        metavar="SECONDS",
        help="close a socket (1000) after this long with no message and no response running;"
        " a response is never cut (default: 900)",
    )
    g.add_argument(
        "--ws-max-queued",
        type=POSITIVE_INT,
        default=16,
        metavar="N",
        help="response.create messages one socket may have waiting or running, on all its"
        " stream_id lanes together; past that the server stops reading it (default: 16)",
    )


def _serve_defaults() -> dict[str, object]:
    """Every flag's default, to tell which ones a command line set."""
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    return vars(parser.parse_args([]))


def _model_name(text: str) -> str:
    """A --served-model-name or --model-alias value (zerohop.api.serving.model_names.check_name)."""
    from zerohop.api.serving.model_names import check_name

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


def _trusted_front(text: str) -> str:
    """A --trusted-front value: IP addresses and CIDR networks, comma-separated."""
    from zerohop.api.http.trusted_front import TrustedFront

    try:
        TrustedFront.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}; give a comma-separated list of them") from None
    return text


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
