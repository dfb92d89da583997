"""zerohop direct (gateway built in) vs the layered stack, same model and workload, one run.

Two topologies, both up for the whole run and driven one at a time, each in front of its own
`zerohop serve` of the default model (unless --model names another) with `--num-threads`
(1) engine threads, so that the load client and the proxies keep a core:

  direct   client --HTTP/1.1--> zerohop serve, gateway on: a fresh --keys-db with one tenant
           and one key, both with rpm / itpm / otpm / max-concurrency limits and a token budget
           (too generous ever to refuse during the run), audit log on, /metrics on.
  layered  client --HTTPS--> nginx --HTTP/1.1 keepalive--> LiteLLM proxy (+ Redis)
           --HTTP--> zerohop serve --no-gateway. nginx terminates TLS (a self-signed cert
           made with `cryptography`) and proxies to LiteLLM as the usual guides for streaming
           LLM APIs configure it: `proxy_http_version 1.1`, `Connection ""` and an upstream
           `keepalive` pool, `proxy_buffering off` and `proxy_cache off` (--nginx-buffering on
           keeps nginx's default, buffering on), `worker_processes auto`, access log on.
           LiteLLM runs `litellm --config config.yaml` (one uvicorn worker) with a `model_list`
           entry `openai/<served name>` at zerohop's `/v1`, per-deployment rpm/tpm limits, a
           per-token cost (so spend accrues) and a global `max_budget`, Redis as its response
           cache and rate-limit/spend coordination store (`litellm_settings.cache`, type
           redis), and per-key limits (rpm, tpm, parallel requests, budget) on the key the
           client sends.

LiteLLM's virtual keys live in Postgres through Prisma. Postgres itself works offline here
(Debian's postgresql 15 binaries), but Prisma's engines are not a package: `prisma` (the Python
client LiteLLM uses) downloads its query and schema engines from binaries.prisma.sh on first
use, which no package registry serves, so on a machine without that host `prisma version`
fails and LiteLLM cannot read a key from the database. The program tries it (`prisma version`,
--prisma-timeout) and, when it fails, falls back to what LiteLLM documents for auth without its
database: `general_settings.custom_auth`, a module that returns the key's `UserAPIKeyAuth`
(its rpm_limit, tpm_limit, max_parallel_requests, max_budget) from a table written by this
program, with `custom_auth_run_common_checks` so that LiteLLM's own budget and model checks and
its Redis rate limiter apply to it as they would to a virtual key; the per-request key lookup in
Postgres (cached by LiteLLM after the first request) is what this leaves out. The report says
which was used (`litellm.auth`), with the Prisma probe's last line.

nginx and redis-server come from Debian (`apt-get install -y nginx redis-server` when missing;
run as root), LiteLLM (pinned, LITELLM_VERSION) from PyPI into its own virtualenv,
`$XDG_CACHE_HOME/zerohop/litellm-venv` (default ~/.cache/...): none of them is a dependency of
zerohop. Every process is started by the program on free 127.0.0.1 ports with its state in a
temporary folder, and stopped at the end, on an error or on Ctrl-C / SIGTERM.

Load: the `zerohop bench` load client (`zerohop.bench.load`): OpenAI chat completions,
streaming, `Authorization: Bearer <key>` (the layered front door over HTTPS, certificate not
verified), messages of random words fitted once to --input-tokens (128) tokens on the direct
server and sent alike to both, --output-tokens (64) with `ignore_eos`, greedy, one warm-up
request per run, prompts seeded per run (no prefix-cache hits between runs; the two
topologies get the same prompts at the same rate, each on its own zerohop).
  capacity  closed loop, --capacity-concurrency (16) streams for --capacity-seconds (30) on
            each topology: request throughput; the rates below are fractions of the direct
            topology's;
  rates     open loop (Poisson arrivals, `request_rate`), --fractions (0.25,0.5,0.75) of that
            capacity, --run-seconds (30) of arrivals each (longer where that makes fewer than
            --min-requests, 25, up to --max-run-seconds, 90), on each topology in turn (the
            order alternates): TTFT, E2E, ITL and TPOT percentiles (p50/p95/p99);
  SLO       per topology, the highest rate that meets the SLO (p95 TTFT <= --slo-ttft-ms,
            1000; no failed request): the fixed-rate runs count as rungs; if all met it, a
            ladder climbs from the top one by --ladder-step (0.125) x capacity (up to
            --ladder-max, 2.0) until a rung misses; then the gap between the highest rate met
            and the lowest missed is halved twice (--ladder-seconds, 20, of arrivals a rung).
Per run, per layer: CPU seconds (user + system time, `_procstat`, of every process of the
layer: nginx master and workers, the LiteLLM process tree, redis-server, zerohop's API process
and its engine process) per completed request (the run's warm-up request counted in), the
layer's RSS (VmRSS summed) at the end of the run and its peak (VmHWM), and Redis commands per
request (INFO stats). Engine busy fraction: the engine process's CPU seconds over the run's
wall time (its one torch thread computes only while a step runs and sleeps between steps;
zerohop exposes no cumulative step time: `ThroughputMeter` keeps a 5 s window and
`/engine/stats` reports tokens/s, and --no-gateway has no /metrics). "other" is the CPU the rest
of the machine used during the run (noise on a shared machine).

    .venv/bin/python benchmarks/topology.py [--fractions 0.25,0.5,0.75] [--run-seconds 30]
        [--slo-ttft-ms 1000] [--only direct|layered] [--out bench-results/topology.json]

Prints the tables; writes --out (bench-results/topology.json), topology-latency.png (TTFT and
E2E percentiles vs rate per topology), topology-cpu.png (CPU per request per layer) beside it,
and every server's log as topology-*.log there.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson
from _common import ROOT, cpu_count, model_path, print_table, write_json
from _procstat import cpu_seconds, machine_busy_s, memory_mib, tree
from serve import free_port, server_pids
from vs_llamacpp import CommandServer, FreshConnections, wait_quiet

from zerohop.bench.load import run_benchmark
from zerohop.bench.load_types import BenchConfig, StreamTimes
from zerohop.sse import Parser

LITELLM_VERSION = "1.106.12"  # 1.108.14+ need proxy packages PyPI lacks; 1.107.x is gone
SERVED_MODEL_NAME = "bench"
TOPOLOGIES = ("direct", "layered")
# Limits on the benchmark's key (and its tenant): present and checked on every request, too
# generous ever to refuse one during the run.
RPM, TPM, CONCURRENCY, BUDGET_TOKENS, BUDGET_USD = 1_000_000, 10**9, 1_000, 10**12, 1_000_000
LAYERS = {
    "direct": ("zerohop_api", "zerohop_engine"),
    "layered": ("nginx", "litellm", "redis", "zerohop_api", "zerohop_engine"),
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="a .gguf file, a HF folder, `standard`, `tiny`")
    p.add_argument("--threads", type=int, default=1, help="engine threads of each zerohop")
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--capacity-concurrency", type=int, default=16)
    p.add_argument("--capacity-seconds", type=float, default=30.0)
    p.add_argument("--fractions", default="0.25,0.5,0.75", help="of the direct capacity")
    p.add_argument("--run-seconds", type=float, default=30.0, help="arrivals per rate run")
    p.add_argument(
        "--min-requests", type=int, default=25,
        help="a run's arrivals last long enough for this many requests...",
    )  # fmt: skip
    p.add_argument("--max-run-seconds", type=float, default=90.0, help="...up to this long")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1: Poisson")
    p.add_argument("--max-in-flight", type=int, default=512, help="open-loop concurrency cap")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="p95 TTFT objective")
    p.add_argument("--ladder-step", type=float, default=0.125, help="x capacity per rung")
    p.add_argument("--ladder-max", type=float, default=2.0, help="x capacity at most")
    p.add_argument("--ladder-seconds", type=float, default=20.0)
    p.add_argument("--no-ladder", action="store_true", help="skip the SLO ladder")
    p.add_argument("--only", choices=TOPOLOGIES, help="measure one topology only")
    p.add_argument(
        "--nginx-buffering", choices=("off", "on"), default="off",
        help="nginx proxy_buffering (the guides: off; nginx's default: on)",
    )  # fmt: skip
    p.add_argument(
        "--no-litellm-cache", action="store_true",
        help="no LiteLLM response cache (Redis then holds limits and spend only)",
    )  # fmt: skip
    p.add_argument(
        "--prisma-timeout", type=float, default=120.0,
        help="seconds `prisma version` may take to fetch its engines (0: skip the probe)",
    )  # fmt: skip
    p.add_argument(
        "--wait-quiet", type=float, default=20.0,
        help="before each run, wait up to this many seconds for an idle machine",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "topology.json")
    p.add_argument(
        "--replot", action="store_true",
        help="measure nothing: print the tables and redraw the plots of --out",
    )  # fmt: skip
    args = p.parse_args(argv)
    args.fractions = [float(f) for f in args.fractions.split(",") if f.strip()]
    return args


# -- installing what the layered stack needs ---------------------------------------------------


def ensure_debian(binary: str, package: str) -> str:
    """The path of `binary`, installed with apt-get (as root) when missing."""
    found = shutil.which(binary) or shutil.which(binary, path="/usr/sbin:/usr/bin:/sbin")
    if found:
        return found
    print(f"installing {package} with apt-get ...", flush=True)
    env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-q", package], check=True, env=env)
    # Debian's packages start their service at install where an init system runs; this program
    # starts its own, so stop that one (harmless where none started).
    subprocess.run(["service", package, "stop"], capture_output=True, check=False)
    found = shutil.which(binary, path="/usr/sbin:/usr/bin:/sbin")
    if not found:
        sys.exit(f"{package} installed but no {binary} found")
    return found


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "zerohop"


def ensure_litellm() -> Path:
    """The virtualenv holding LiteLLM's proxy (and Prisma's Python client), made once."""
    venv = cache_root() / "litellm-venv"
    python = venv / "bin" / "python"
    marker = venv / f".litellm-{LITELLM_VERSION}"
    if marker.exists():
        return venv
    print(f"installing litellm[proxy]=={LITELLM_VERSION} into {venv} ...", flush=True)
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, f"litellm[proxy]=={LITELLM_VERSION}", "prisma"], check=True)
    marker.touch()
    return venv


def prisma_probe(venv: Path, timeout: float) -> tuple[bool, str]:
    """Whether Prisma can run here (its CLI and engines fetched), and the probe's last line."""
    if timeout <= 0:
        return False, "skipped (--prisma-timeout 0)"
    try:
        done = subprocess.run(
            [str(venv / "bin" / "prisma"), "version"], capture_output=True, text=True,
            timeout=timeout, cwd=tempfile.gettempdir(),
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return False, f"`prisma version` did not finish in {timeout:.0f}s"
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    return done.returncode == 0, lines[-1] if lines else f"exit {done.returncode}"


# -- TLS ----------------------------------------------------------------------------------------


def self_signed_cert(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 / localhost (EC P-256, 1 day) and its key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    san = x509.SubjectAlternativeName(
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(san, critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def insecure_tls() -> None:
    """Make the load client skip certificate checks (it creates its own aiohttp connector and
    has no option for it): the layered stack's front door has a self-signed certificate."""
    import aiohttp

    if getattr(aiohttp.TCPConnector, "_topology_insecure", False):
        return

    class InsecureConnector(aiohttp.TCPConnector):
        _topology_insecure = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("ssl", False)
            super().__init__(*args, **kwargs)

    aiohttp.TCPConnector = InsecureConnector


# -- processes ----------------------------------------------------------------------------------


class Proc:
    """A server started in a session of its own (Ctrl-C reaches only this program, which then
    stops it), logging to `log`, ready once `ready()` is true; a context manager."""

    def __init__(self, name: str, cmd: list[str], log: Path, ready: Any, **popen: Any) -> None:
        self.name, self.cmd, self.log, self.ready, self.popen = name, cmd, log, ready, popen

    def __enter__(self) -> Proc:
        start = time.monotonic()
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                self.cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                **self.popen,
            )  # fmt: skip
        deadline = start + 180
        while not self.ready():
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited early; log: {self.log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready after 180 s; log: {self.log}")
            time.sleep(0.25)
        print(f"  {self.name} ready in {time.monotonic() - start:.1f}s", flush=True)
        return self

    @property
    def pid(self) -> int:
        return self.process.pid

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        # Children that outlived their leader (the session's group): make sure they go.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)


def http_ok(url: str, timeout: float = 1.0, headers: dict | None = None) -> bool:
    import ssl

    context = ssl._create_unverified_context()
    try:
        request = urllib.request.Request(url, headers=headers or {})
        with urllib.request.urlopen(request, timeout=timeout, context=context) as r:
            return r.status == 200
    except OSError:
        return False


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


# -- the two topologies --------------------------------------------------------------------------


def zerohop_cmd(model: Path, args: argparse.Namespace, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "zerohop", "serve", str(model), "--grpc-port", "0"]
    cmd += ["--served-model-name", SERVED_MODEL_NAME, "--num-threads", str(args.threads)]
    return cmd + extra


def make_key(db: Path) -> str:
    zerohop = [sys.executable, "-m", "zerohop", "keys"]
    limits = ["--rpm", str(RPM), "--itpm", str(TPM), "--otpm", str(TPM)]
    limits += ["--max-concurrency", str(CONCURRENCY), "--budget", str(BUDGET_TOKENS)]
    db_arg = ["--keys-db", str(db)]
    subprocess.run([*zerohop, "tenant", "bench", *limits, *db_arg], check=True, capture_output=True)
    create = [*zerohop, "create", "--tenant", "bench", "--name", "topology", *limits, "--json"]
    out = subprocess.run([*create, *db_arg], check=True, capture_output=True)
    return json.loads(out.stdout)["key"]


CUSTOM_AUTH = '''\
"""LiteLLM custom auth (written by zerohop's benchmarks/topology.py): the per-key limits a
virtual key carries, from keys.json beside this file, without LiteLLM's Postgres database."""

import json
from pathlib import Path

from litellm.proxy._types import UserAPIKeyAuth

KEYS = json.loads((Path(__file__).parent / "keys.json").read_text())


async def user_api_key_auth(request, api_key: str) -> UserAPIKeyAuth:
    fields = KEYS.get(api_key)
    if fields is None:
        raise Exception("invalid API key")
    return UserAPIKeyAuth(api_key=api_key, **fields)
'''


def litellm_config(
    folder: Path, zerohop_port: int, redis_port: int, key: str, args: argparse.Namespace
) -> Path:
    """config.yaml (JSON is YAML), and the custom-auth module with its key table."""
    redis = {"host": "127.0.0.1", "port": redis_port}
    litellm_settings: dict[str, Any] = {
        "max_budget": BUDGET_USD,
        "budget_duration": "30d",
        "request_timeout": 600,
        "enable_post_custom_auth_checks": True,
    }
    if not args.no_litellm_cache:
        litellm_settings |= {"cache": True, "cache_params": {"type": "redis", **redis}}
    config = {
        "model_list": [
            {
                "model_name": SERVED_MODEL_NAME,
                "litellm_params": {
                    "model": f"openai/{SERVED_MODEL_NAME}",
                    "api_base": f"http://127.0.0.1:{zerohop_port}/v1",
                    "api_key": "none",
                    "rpm": RPM,
                    "tpm": TPM,
                    "input_cost_per_token": 1e-7,
                    "output_cost_per_token": 2e-7,
                },
            }
        ],
        "litellm_settings": litellm_settings,
        "router_settings": {"redis_host": "127.0.0.1", "redis_port": redis_port},
        "general_settings": {
            "master_key": "sk-topology-master",
            "custom_auth": "custom_auth.user_api_key_auth",
            "custom_auth_run_common_checks": True,
        },
    }
    keys = {
        key: {
            "key_alias": "topology",
            "rpm_limit": RPM,
            "tpm_limit": TPM,
            "max_parallel_requests": CONCURRENCY,
            "max_budget": BUDGET_USD,
            "spend": 0.0,
            "models": [SERVED_MODEL_NAME],
        }
    }
    (folder / "keys.json").write_text(json.dumps(keys))
    (folder / "custom_auth.py").write_text(CUSTOM_AUTH)
    path = folder / "config.yaml"
    path.write_text(json.dumps(config, indent=2))
    return path


def nginx_config(
    folder: Path, port: int, upstream: int, cert: Path, key: Path, buffering: str
) -> Path:
    for sub in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (folder / sub).mkdir(exist_ok=True)
        (folder / sub).chmod(0o777)  # the workers run as nobody
    text = f"""\
worker_processes auto;
daemon off;
pid {folder}/nginx.pid;
error_log {folder}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log {folder}/access.log;
    client_body_temp_path {folder}/client_body;
    proxy_temp_path {folder}/proxy;
    fastcgi_temp_path {folder}/fastcgi;
    uwsgi_temp_path {folder}/uwsgi;
    scgi_temp_path {folder}/scgi;
    upstream litellm {{
        server 127.0.0.1:{upstream};
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port} ssl;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        ssl_protocols TLSv1.2 TLSv1.3;
        ssl_session_cache shared:SSL:10m;
        client_max_body_size 10m;
        location / {{
            proxy_pass http://litellm;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $host;
            proxy_set_header X-Real-IP $remote_addr;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_set_header X-Forwarded-Proto $scheme;
            proxy_buffering {buffering};
            proxy_cache off;
            proxy_read_timeout 600s;
            proxy_send_timeout 600s;
        }}
    }}
}}
"""
    path = folder / "nginx.conf"
    path.write_text(text)
    return path


class Topology:
    """One topology's processes, its front door and key, and per-layer accounting."""

    def __init__(self, name: str, url: str, key: str, layers: dict[str, Any]) -> None:
        self.name, self.url, self.key = name, url, key
        self.layers = layers  # layer -> callable returning its pids now
        self.redis_port: int | None = None
        self.metrics_url: str | None = None

    def pids(self) -> dict[str, list[int]]:
        return {layer: list(get()) for layer, get in self.layers.items()}


def start_direct(stack: contextlib.ExitStack, model: Path, args, tmp: Path) -> Topology:
    print("\n== direct: zerohop serve, gateway on", flush=True)
    db = tmp / "direct" / "keys.db"
    db.parent.mkdir(parents=True)
    key = make_key(db)
    extra = ["--keys-db", str(db), "--audit-dir", str(tmp / "direct" / "audit")]
    log = args.out.parent / "topology-direct-zerohop.log"
    server = stack.enter_context(CommandServer(zerohop_cmd(model, args, extra), "/ready", log))
    pids = server_pids(server.process.pid)
    layers = {"zerohop_api": lambda: [pids["api"]], "zerohop_engine": lambda: [pids["engine"]]}
    topo = Topology("direct", server.url, key, layers)
    topo.metrics_url = server.url + "/metrics"
    return topo


def start_layered(
    stack: contextlib.ExitStack, model: Path, args, tmp: Path, venv: Path, key: str
) -> Topology:
    print(f"\n== layered: nginx (TLS) -> LiteLLM {LITELLM_VERSION} + Redis -> zerohop "
          "--no-gateway", flush=True)  # fmt: skip
    nginx = ensure_debian("nginx", "nginx")
    redis = ensure_debian("redis-server", "redis-server")
    folder = tmp / "layered"
    folder.mkdir()
    logs = args.out.parent
    log = logs / "topology-layered-zerohop.log"
    cmd = zerohop_cmd(model, args, ["--no-gateway"])
    zerohop = stack.enter_context(CommandServer(cmd, "/ready", log))
    zpids = server_pids(zerohop.process.pid)

    redis_port = free_port()
    (folder / "redis").mkdir()
    redis_cmd = [
        redis, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
        "--appendonly", "no", "--dir", str(folder / "redis"), "--daemonize", "no",
    ]  # fmt: skip
    redis_proc = stack.enter_context(
        Proc("redis-server", redis_cmd, logs / "topology-layered-redis.log",
             lambda: port_open(redis_port))
    )  # fmt: skip

    litellm_port = free_port()
    config = litellm_config(folder, zerohop.port, redis_port, key, args)
    env = os.environ | {
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no fetch of the cost map from the internet
        "LITELLM_TELEMETRY": "False",
        "PYTHONPATH": str(folder),  # custom_auth.py
        "DISABLE_ADMIN_UI": "True",
    }
    env.pop("DATABASE_URL", None)
    litellm_cmd = [str(venv / "bin" / "litellm"), "--config", str(config), "--host",
                   "127.0.0.1", "--port", str(litellm_port), "--num_workers", "1"]  # fmt: skip
    health = f"http://127.0.0.1:{litellm_port}/health/liveliness"
    litellm = stack.enter_context(
        Proc("litellm", litellm_cmd, logs / "topology-layered-litellm.log",
             lambda: http_ok(health), env=env, cwd=folder)
    )  # fmt: skip

    nginx_port = free_port()
    cert, cert_key = self_signed_cert(folder)
    conf = nginx_config(folder, nginx_port, litellm_port, cert, cert_key, args.nginx_buffering)
    nginx_cmd = [nginx, "-c", str(conf), "-p", str(folder), "-e", str(folder / "error.log")]
    url = f"https://127.0.0.1:{nginx_port}"
    nginx_proc = stack.enter_context(
        Proc("nginx", nginx_cmd, logs / "topology-layered-nginx.log",
             lambda: http_ok(url + "/health/liveliness"))
    )  # fmt: skip
    layers = {
        "nginx": lambda: tree(nginx_proc.pid),
        "litellm": lambda: tree(litellm.pid),
        "redis": lambda: [redis_proc.pid],
        "zerohop_api": lambda: [zpids["api"]],
        "zerohop_engine": lambda: [zpids["engine"]],
    }
    topo = Topology("layered", url, key, layers)
    topo.redis_port = redis_port
    topo.metrics_url = None
    return topo


def redis_keys(port: int) -> dict[str, int]:
    """What Redis holds at the end: key counts by their first two `:`-separated fields."""
    cli = shutil.which("redis-cli")
    if cli is None:
        return {}
    out = subprocess.run([cli, "-p", str(port), "--scan"], capture_output=True, text=True)
    counts: dict[str, int] = {}
    for key in out.stdout.split():
        parts = key.split(":")
        prefix = ":".join(p if len(p) < 24 else "<id>" for p in parts[:2])
        counts[prefix] = counts.get(prefix, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1])[:30])


def redis_commands(port: int | None) -> int:
    """Commands Redis has processed so far (INFO stats), over a raw socket."""
    if port is None:
        return 0
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(b"INFO stats\r\n")
        data = b""
        while b"total_commands_processed" not in data or not data.endswith(b"\r\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    for line in data.decode(errors="replace").splitlines():
        if line.startswith("total_commands_processed:"):
            return int(line.split(":")[1])
    return 0


# -- the load ----------------------------------------------------------------------------------


class SameWords(FreshConnections):
    """The load client with two changes, the same for both topologies (on top of
    vs_llamacpp's `Connection: close` on every request, which these runs have always had):
    - the number of words per message is fitted once (on the first topology that runs:
      zerohop direct, whose /v1/messages/count_tokens counts them) and kept for every run:
      LiteLLM has no count_tokens, so the client's own fit would give the two topologies
      different prompts;
    - chat chunks are read by `read_chat`: a token event is a chunk whose delta has text.
      LiteLLM sends its usage in a chunk with `"choices":[{"index":0,"delta":{}}]` (no
      finish_reason), which `zerohop.bench.token_events` counts as one more token event (one
      extra ITL sample and a later E2E per request)."""

    words: int | None = None

    def __init__(self, cfg: BenchConfig, session: Any) -> None:
        super().__init__(cfg, session)
        self.reader = read_chat

    async def _fit_words(self, model: str, tries: int = 4) -> int:
        if SameWords.words is None:
            SameWords.words = await super()._fit_words(model, tries)
        return SameWords.words


async def read_chat(chunks: Any, s: StreamTimes) -> None:
    """Token events and usage of an OpenAI chat stream, every chunk parsed (orjson)."""
    parser = Parser()
    async for chunk in chunks:
        for event in parser.feed(chunk):
            payload = event.data
            if not payload:
                continue
            if payload == b"[DONE]":
                return
            data = orjson.loads(payload)
            for choice in data.get("choices") or ():
                if (choice.get("delta") or {}).get("content") or choice.get("text"):
                    s.token_event()
            if usage := data.get("usage"):
                s.prompt_tokens = usage.get("prompt_tokens") or 0
                s.output_tokens = usage.get("completion_tokens") or 0
            if error := data.get("error"):
                s.error = f"stream error: {error.get('message', error)}"


def bench_config(args, topo: Topology, seed: int, **fields: Any) -> BenchConfig:
    return BenchConfig(
        url=topo.url, endpoint="openai-chat", input_tokens=args.input_tokens,
        output_tokens=args.output_tokens, model=SERVED_MODEL_NAME, api_key=topo.key,
        seed=seed, **fields,
    )  # fmt: skip


def measured_run(args, topo: Topology, everything: list[Topology], cfg: BenchConfig) -> dict:
    """One load-client run, with the CPU of every layer of every topology around it."""
    wait_quiet(args.wait_quiet)
    pids = {t.name: t.pids() for t in everything}
    redis_before = redis_commands(topo.redis_port)
    before = {t: {layer: cpu_seconds(ps) for layer, ps in ls.items()} for t, ls in pids.items()}
    client0, machine0, wall0 = time.process_time(), machine_busy_s(), time.perf_counter()
    report = run_benchmark(cfg, client_class=SameWords)
    wall = time.perf_counter() - wall0
    client = time.process_time() - client0
    machine = machine_busy_s() - machine0
    after = {t: {layer: cpu_seconds(ps) for layer, ps in ls.items()} for t, ls in pids.items()}
    summary = report["summary"]
    done = summary["completed"] + cfg.warmup_requests
    cpu = {layer: after[topo.name][layer] - before[topo.name][layer] for layer in pids[topo.name]}
    idle_other = sum(
        after[t][layer] - before[t][layer] for t in after if t != topo.name for layer in after[t]
    )
    measured = sum(after[t][layer] - before[t][layer] for t in after for layer in after[t])
    summary["wall_s"] = wall
    summary["cpu_s"] = cpu
    summary["cpu_s_per_request"] = {layer: s / done for layer, s in cpu.items()}
    summary["cpu_s_per_request"]["total"] = sum(cpu.values()) / done
    summary["cpu_s_client"] = client
    summary["cpu_s_idle_topology"] = idle_other
    summary["cpu_cores_other"] = max(0.0, machine - measured - client) / wall
    summary["engine_busy"] = cpu["zerohop_engine"] / wall
    summary["memory"] = {layer: memory_mib(ps) for layer, ps in pids[topo.name].items()}
    summary["redis_commands_per_request"] = (
        (redis_commands(topo.redis_port) - redis_before) / done if topo.redis_port else None
    )
    summary["pids"] = {layer: ps for layer, ps in pids[topo.name].items()}
    if summary["failed"]:
        print(f"  ! {summary['failed']} failed: {summary['errors'][:2]}")
    return summary


def line(topo: str, label: str, s: dict) -> str:
    ttft, e2e, itl = s["ttft_ms"] or {}, s["e2el_ms"] or {}, s["itl_ms"] or {}
    return (
        f"  {topo:<8} {label:<16} {s['completed']:>4} ok {s['failed']:>3} failed  "
        f"{s['request_throughput']:.2f} req/s  TTFT p50/p95 {ttft.get('p50', 0):.0f}/"
        f"{ttft.get('p95', 0):.0f} ms  ITL p50 {itl.get('p50', 0):.1f} ms  E2E p95 "
        f"{e2e.get('p95', 0):.0f} ms  CPU/req {s['cpu_s_per_request']['total'] * 1000:.0f} ms"
        f"  engine busy {s['engine_busy']:.2f}  other {s['cpu_cores_other']:.2f} cores"
    )


def capacity(args, topo: Topology, everything: list[Topology]) -> dict:
    cfg = bench_config(
        args, topo, seed=1, concurrency=args.capacity_concurrency, num_requests=10**6,
        duration_s=args.capacity_seconds,
    )  # fmt: skip
    s = measured_run(args, topo, everything, cfg)
    print(line(topo.name, f"closed c={args.capacity_concurrency}", s), flush=True)
    return s


def open_loop(args, topo, everything, rate: float, seconds: float, seed: int) -> dict:
    seconds = max(seconds, min(args.min_requests / rate, args.max_run_seconds))
    cfg = bench_config(
        args, topo, seed=seed, concurrency=args.max_in_flight, num_requests=10**6,
        request_rate=rate, burstiness=args.burstiness, duration_s=seconds,
    )  # fmt: skip
    s = measured_run(args, topo, everything, cfg)
    s["offered_rate"] = rate
    s["slo_met"] = slo_met(args, s)
    print(line(topo.name, f"{rate:.2f} req/s", s), flush=True)
    return s


def slo_met(args, s: dict) -> bool:
    ttft = s["ttft_ms"]
    return bool(ttft) and not s["failed"] and ttft["p95"] <= args.slo_ttft_ms


# -- report ----------------------------------------------------------------------------------------


def pct(d: dict | None, p: str) -> float | None:
    return None if not d else d.get(p)


def latency_rows(results: dict) -> list[list[object]]:
    rows = []
    for name, runs in results["rates"].items():
        for r in runs:
            t, e = r["ttft_ms"], r["e2el_ms"]
            rows.append([
                name, r["fraction"], r["offered_rate"], r["request_throughput"],
                pct(t, "p50"), pct(t, "p95"), pct(t, "p99"),
                pct(e, "p50"), pct(e, "p95"), pct(e, "p99"), r["failed"],
            ])  # fmt: skip
    return rows


def token_delay_rows(results: dict) -> list[list[object]]:
    """Per rate: layered minus direct, TTFT p50 and ITL / TPOT percentiles."""
    rates = results["rates"]
    if not all(n in rates for n in TOPOLOGIES):
        return []
    rows = []
    for d, lay in zip(rates["direct"], rates["layered"], strict=True):
        row: list[object] = [d["fraction"], d["offered_rate"]]
        for metric, ps in (("ttft_ms", ("p50", "p95")), ("itl_ms", ("p50", "p95", "p99")),
                           ("tpot_ms", ("p50", "p95"))):  # fmt: skip
            for p in ps:
                a, b = pct(d[metric], p), pct(lay[metric], p)
                row.append(None if a is None or b is None else b - a)
        rows.append(row)
    return rows


def cpu_rows(results: dict) -> list[list[object]]:
    rows = []
    for name, runs in results["rates"].items():
        for r in runs:
            per = r["cpu_s_per_request"]
            row = [name, r["offered_rate"]]
            row += [per.get(layer, 0.0) * 1000 if layer in per else None for layer in
                    ("nginx", "litellm", "redis", "zerohop_api", "zerohop_engine")]  # fmt: skip
            row += [per["total"] * 1000, r["engine_busy"], r["redis_commands_per_request"],
                    r["cpu_cores_other"]]  # fmt: skip
            rows.append(row)
    return rows


def memory_rows(results: dict) -> list[list[object]]:
    rows = []
    for name, runs in results["rates"].items():
        if not runs:
            continue
        last = runs[-1]["memory"]
        for layer, m in last.items():
            rows.append([name, layer, m["rss_mib"], m["peak_rss_mib"]])
    return rows


def print_report(results: dict, args) -> None:
    cap = results["capacity"]
    print(f"\n== capacity, closed loop, {args.capacity_concurrency} streams, "
          f"{args.input_tokens} -> {args.output_tokens} tokens")  # fmt: skip
    print_table(
        ["topology", "req/s", "output tok/s", "TTFT p50 ms", "ITL p50 ms", "CPU ms/req"],
        [[n, s["request_throughput"], s["output_throughput"], pct(s["ttft_ms"], "p50"),
          pct(s["itl_ms"], "p50"), s["cpu_s_per_request"]["total"] * 1000]
         for n, s in cap.items()],
    )  # fmt: skip
    print(f"\n== latency vs rate (open loop, Poisson; rates = fractions of direct capacity "
          f"{results['capacity_rate']:.2f} req/s)")  # fmt: skip
    print_table(
        ["topology", "x cap", "rate", "done/s", "TTFT p50", "p95", "p99", "E2E p50", "p95",
         "p99", "failed"],
        latency_rows(results),
    )  # fmt: skip
    if rows := token_delay_rows(results):
        print("\n== added by the layered stack at the same rate (layered - direct, ms)")
        print_table(
            ["x cap", "rate", "TTFT p50", "TTFT p95", "ITL p50", "ITL p95", "ITL p99",
             "TPOT p50", "TPOT p95"],
            rows,
        )  # fmt: skip
    print("\n== CPU ms per request by layer (engine busy: engine CPU / wall)")
    print_table(
        ["topology", "rate", "nginx", "litellm", "redis", "zh api", "zh engine", "total",
         "engine busy", "redis cmd/req", "other cores"],
        cpu_rows(results),
    )  # fmt: skip
    print("\n== memory by layer at the end of the last rate run (MiB)")
    print_table(["topology", "layer", "RSS", "peak RSS"], memory_rows(results))
    if results["slo"]:
        print(f"\n== highest rate within the SLO (p95 TTFT <= {args.slo_ttft_ms:.0f} ms, "
              "no failures), rate ladder")  # fmt: skip
        print_table(
            ["topology", "sustained req/s", "x cap", "first miss req/s", "rungs"],
            [[n, s["sustained_rate"], (s["sustained_rate"] or 0) / results["capacity_rate"],
              s["first_miss"], len(s["ladder"])] for n, s in results["slo"].items()],
        )  # fmt: skip


def plots(results: dict, out: Path) -> list[Path]:
    from zerohop.bench.plots import pyplot, save

    plt = pyplot()
    paths = []
    colors = {"direct": "tab:blue", "layered": "tab:red"}
    styles = {"p50": "-", "p95": "--", "p99": ":"}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for ax, metric, title in zip(
        axes, ("ttft_ms", "e2el_ms", "itl_ms"), ("TTFT", "end-to-end", "inter-token"),
        strict=True,
    ):  # fmt: skip
        for name, runs in results["rates"].items():
            ladder = results["slo"].get(name, {}).get("ladder", [])
            points = sorted(runs + ladder, key=lambda r: r["offered_rate"])
            points = [r for r in points if r[metric]]
            for p, style in styles.items():
                xs = [r["offered_rate"] for r in points]
                ys = [r[metric][p] for r in points]
                ax.plot(xs, ys, style, color=colors[name], marker="o", ms=3, label=f"{name} {p}")
        if metric == "ttft_ms" and results["slo"]:
            ax.axhline(results["slo_ttft_ms"], color="gray", lw=0.8, label="SLO (p95)")
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.set_title(f"{title} latency")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("zerohop direct vs nginx -> LiteLLM -> zerohop: latency percentiles vs rate")
    paths.append(save(fig, out.with_name("topology-latency.png")))

    layers = ("nginx", "litellm", "redis", "zerohop_api", "zerohop_engine")
    layer_colors = ("tab:green", "tab:red", "tab:brown", "tab:blue", "tab:gray")
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
    for ax, shown, title in (
        (axes[0], layers, "all layers"),
        (axes[1], layers[:-1], "without the engine: what serving and the gateway cost"),
    ):
        positions, labels, x = [], [], 0.0
        for name, runs in results["rates"].items():
            for r in runs:
                bottom = 0.0
                for layer, color in zip(layers, layer_colors, strict=True):
                    if layer not in shown:
                        continue
                    v = r["cpu_s_per_request"].get(layer, 0.0) * 1000
                    ax.bar(x, v, bottom=bottom, color=color, label=None if positions else layer)
                    bottom += v
                positions.append(x)
                labels.append(f"{name}\n{r['offered_rate']:.2f}/s")
                x += 1
            x += 0.5
        ax.set_xticks(positions, labels, fontsize=8)
        ax.set_ylabel("CPU ms per request")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("CPU per request by layer (utime + stime of each layer's processes)")
    paths.append(save(fig, out.with_name("topology-cpu.png")))
    return paths


# -- main -----------------------------------------------------------------------------------------


def slo_search(args, topo, everything, cap_rate: float, fixed: list[dict]) -> dict:
    """The highest rate within the SLO: the fixed-rate runs count as rungs; if all of them
    met it, climb by --ladder-step x capacity until a rung misses (or --ladder-max); if one
    missed, halve the gap between the highest met and the lowest missed rate, twice."""
    rungs: list[dict] = []
    met = [r["offered_rate"] for r in fixed if r["slo_met"]]
    missed = [r["offered_rate"] for r in fixed if not r["slo_met"]]
    seed = 1000

    def run(rate: float) -> None:
        nonlocal seed
        s = open_loop(args, topo, everything, rate, args.ladder_seconds, seed)
        s["fraction"] = rate / cap_rate
        rungs.append(s)
        (met if s["slo_met"] else missed).append(rate)
        seed += 1

    x = max(r["fraction"] for r in fixed) if fixed else 0.0
    while not missed and x + args.ladder_step <= args.ladder_max + 1e-9:
        x += args.ladder_step
        run(x * cap_rate)
    for _ in range(2):
        low, high = max((r for r in met if r < min(missed)), default=0.0), min(missed)
        if high - low < 0.05 * cap_rate:
            break
        run((low + high) / 2)
    sustained = max((r for r in met if not missed or r < min(missed)), default=None)
    return {
        "sustained_rate": sustained,
        "first_miss": min(missed) if missed else None,
        "ladder": rungs,
    }


@contextlib.contextmanager
def stopped_on_sigterm() -> Iterator[None]:
    # As Ctrl-C: inside the load client's event loop SIGINT cancels the run and raises
    # KeyboardInterrupt (a SystemExit raised from a handler there is lost), and the ExitStack
    # then stops every server.
    previous = signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.replot:
        results = json.loads(args.out.read_text())
        args.slo_ttft_ms = results["slo_ttft_ms"]
        args.input_tokens = results["workload"]["input_tokens"]
        args.output_tokens = results["workload"]["output_tokens"]
        args.capacity_concurrency = results.get("capacity_concurrency", args.capacity_concurrency)
        print_report(results, args)
        print("\nwrote", ", ".join(str(p) for p in plots(results, args.out)))
        return results
    started = time.monotonic()
    model = model_path(args.model)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    insecure_tls()
    names = [args.only] if args.only else list(TOPOLOGIES)
    venv = probe = None
    prisma_ok, prisma_line = False, "not tried"
    if "layered" in names:
        venv = ensure_litellm()
        print("probing Prisma (LiteLLM's virtual keys need its engines) ...", flush=True)
        prisma_ok, prisma_line = prisma_probe(venv, args.prisma_timeout)
        probe = {"prisma_ok": prisma_ok, "prisma_probe": prisma_line}
        print(f"  prisma: {'ok' if prisma_ok else 'unavailable'}: {prisma_line}")
        print("  LiteLLM auth: custom_auth per-key limits (no Postgres); see the docstring")
    results: dict[str, Any] = {
        "model": str(model), "threads": args.threads, "cpus": cpu_count(),
        "workload": {"input_tokens": args.input_tokens, "output_tokens": args.output_tokens,
                     "endpoint": "openai-chat", "burstiness": args.burstiness},
        "litellm": {"version": LITELLM_VERSION, "auth": "custom_auth (no database)",
                    **(probe or {}), "response_cache": not args.no_litellm_cache,
                    "redis": "response cache + rate-limit/spend coordination"},
        "nginx": {"proxy_buffering": args.nginx_buffering, "tls": "TLS 1.2/1.3, self-signed "
                  "EC P-256, client does not verify", "upstream_keepalive": 64},
        "slo_ttft_ms": args.slo_ttft_ms, "capacity_concurrency": args.capacity_concurrency,
        "capacity": {}, "rates": {}, "slo": {},
    }  # fmt: skip
    with stopped_on_sigterm(), contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="zerohop-topology-")))
        tmp.chmod(0o755)  # nginx workers (nobody) read the cert path's parents
        topos: dict[str, Topology] = {}
        key = None
        if "direct" in names:
            topos["direct"] = start_direct(stack, model, args, tmp)
            key = topos["direct"].key
        if "layered" in names:
            key = key or "sk-topology-" + os.urandom(12).hex()
            topos["layered"] = start_layered(stack, model, args, tmp, venv, key)
        everything = list(topos.values())

        print("\n== capacity (closed loop)", flush=True)
        for name in names:
            results["capacity"][name] = capacity(args, topos[name], everything)
        cap_rate = results["capacity"][names[0]]["request_throughput"]
        results["capacity_rate"] = cap_rate
        print(f"  rates relative to {names[0]}'s {cap_rate:.2f} req/s: "
              f"{', '.join(f'{f:g}' for f in args.fractions)}")  # fmt: skip

        print("\n== open loop at fixed rates", flush=True)
        results["rates"] = {name: [] for name in names}
        for i, fraction in enumerate(args.fractions):
            order = names if i % 2 == 0 else names[::-1]
            for name in order:
                s = open_loop(args, topos[name], everything, fraction * cap_rate,
                              args.run_seconds, seed=10 + i)  # fmt: skip
                s["fraction"] = fraction
                results["rates"][name].append(s)

        if not args.no_ladder:
            print(f"\n== SLO ladder (p95 TTFT <= {args.slo_ttft_ms:.0f} ms)", flush=True)
            for name in names:
                fixed = results["rates"][name]
                results["slo"][name] = slo_search(args, topos[name], everything, cap_rate, fixed)
        if "layered" in topos:
            results["litellm"]["redis_keys"] = redis_keys(topos["layered"].redis_port)
        if "direct" in topos:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(topos["direct"].metrics_url, timeout=5) as r:
                    text = r.read().decode()
                results["direct_metrics_sample"] = [
                    m for m in text.splitlines() if m.startswith(("vllm:", "zerohop_requests"))
                ][:40]
    results["wall_s"] = time.monotonic() - started
    for runs in results["rates"].values():
        for r in runs:
            r.pop("pids", None)
    write_json(args.out, results)
    print_report(results, args)
    paths = plots(results, args.out)
    print(f"\nwall time {results['wall_s']:.0f} s; wrote {args.out}, "
          f"{', '.join(str(p) for p in paths)}")  # fmt: skip
    return results


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
