"""What `zerohop serve` runs with (`ServeOptions`, its gateway's and its batches'): built by
the command line (zerohop/cli/serve.py), read by zerohop/app/server.py and the parts it opens."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from zerohop.api.http.asgi import BodyDeadline
from zerohop.api.http.guard import GuardLimits
from zerohop.api.http.keepalive import DEFAULT_OPENAI_PING_INTERVAL, DEFAULT_PING_INTERVAL
from zerohop.api.http.websocket import SocketLimits
from zerohop.api.load.overload import DEFAULT_MAX_QUEUE_WAIT, DEFAULT_MAX_WAITING
from zerohop.api.serving.service import DEFAULT_MAX_BODY_BYTES
from zerohop.engine.base.options import EngineOptions
from zerohop.engine.process.supervisor import RestartPolicy
from zerohop.gateway.fleet_options import LeaseOptions, SnapshotOptions
from zerohop.gateway.server_keys import DEFAULT_ROTATION


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
    # Peers whose end-user headers (x-claude-gateway-user-id, ...) are believed: IPs, CIDRs.
    trusted_front: str = ""
    secure_cookies: bool = False  # the console's cookie Secure even on a plain-HTTP request
    served_model_name: list[str] | None = None  # concrete names or globs (model_names.py)
    model_aliases: list[str] | None = None  # None: any name, unless served_model_name is set
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    drain_seconds: float = 30.0
    engine: str = "zerohop"  # or "vllm": vLLM's AsyncLLM (zerohop.engine.vllm)
    engine_options: EngineOptions | None = None
    gateway: GatewayOptions = field(default_factory=lambda: GatewayOptions())
    guard: GuardLimits = field(default_factory=GuardLimits)
    keep_alive_timeout: float = 5.0
    grpc_max_concurrent_streams: int = 100
    body_deadline: BodyDeadline = field(default_factory=BodyDeadline)
    max_header_bytes: int = 32 * 1024
    # WebSocket mode on /v1/responses: its idle timeout and read-ahead (api/http/websocket.py).
    socket_limits: SocketLimits = field(default_factory=SocketLimits)
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
