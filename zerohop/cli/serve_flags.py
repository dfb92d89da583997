"""`zerohop serve`'s flag groups beyond the engine's: supervision of the engine process, the
protection a reverse proxy used to give, and the gateway (keys, limits, audit, metrics, the
fleet store)."""

from __future__ import annotations

import argparse
from pathlib import Path

from zerohop.cli.arg_types import (
    NONNEGATIVE_INT,
    NONNEGATIVE_NUMBER,
    POSITIVE_INT,
    POSITIVE_NUMBER,
    SHARE,
    integer,
    number,
)


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
