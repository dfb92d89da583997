"""The stack zerohop replaces, in front of any OpenAI-compatible upstream on 127.0.0.1:
client --HTTPS--> nginx (TLS, `proxy_buffering` as asked, keepalive upstream) --> LiteLLM's
proxy (per-key limits through custom auth, a budget, Redis for its limits and spend, and
optionally its Redis response cache) --> the upstream.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _procstat import tree

from harness.peers import LITELLM_VERSION, child_env, ensure_debian, ensure_litellm
from harness.procs import Proc, free_port, http_ok, port_open

# Limits on the benchmark's key: present and checked on every request, too generous to refuse.
RPM, TPM, CONCURRENCY, BUDGET_USD = 1_000_000, 10**9, 1_000, 1_000_000

CUSTOM_AUTH = '''\
"""LiteLLM custom auth (written by zerohop's benchmarks): the per-key limits a virtual key
carries, from keys.json beside this file, without LiteLLM's Postgres database."""

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


@dataclass
class Layered:
    """The stack's front door, its key, Redis's port and each layer's pids (read when asked)."""

    url: str
    key: str
    redis_port: int
    layers: dict[str, Callable[[], list[int]]] = field(default_factory=dict)
    logs: list[Path] = field(default_factory=list)

    def pids(self) -> dict[str, list[int]]:
        return {layer: list(get()) for layer, get in self.layers.items()}


@contextlib.contextmanager
def layered_stack(
    folder: Path, upstream_port: int, model_name: str, logs: Path, *, buffering: str = "off",
    response_cache: bool = False,
) -> Iterator[Layered]:  # fmt: skip
    """nginx -> LiteLLM + Redis in front of the upstream, in `folder`, logs `logs`-*.log."""
    print(f"  layered: nginx (TLS) -> LiteLLM {LITELLM_VERSION} + Redis", flush=True)
    key = "sk-bench-" + os.urandom(12).hex()
    folder.chmod(0o755)  # nginx workers (nobody) read the certificate path's parents
    with contextlib.ExitStack() as stack:
        redis, redis_port = stack.enter_context(start_redis(folder, logs))
        config = litellm_config(folder, upstream_port, redis_port, key, model_name, response_cache)
        litellm, litellm_port = stack.enter_context(start_litellm(folder, config, logs))
        nginx, url = stack.enter_context(start_nginx(folder, litellm_port, buffering, logs))
        front = Layered(url, key, redis_port)
        front.layers = {
            "nginx": lambda: tree(nginx.pid),
            "litellm": lambda: tree(litellm.pid),
            "redis": lambda: [redis.pid],
        }
        front.logs = [redis.log, litellm.log, nginx.log]
        yield front


def start_redis(folder: Path, logs: Path) -> contextlib.AbstractContextManager[Any]:
    port = free_port()
    (folder / "redis").mkdir(exist_ok=True)
    cmd = [
        ensure_debian("redis-server", "redis-server"), "--port", str(port), "--bind",
        "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(folder / "redis"),
        "--daemonize", "no",
    ]  # fmt: skip
    proc = Proc("redis-server", cmd, Path(f"{logs}-redis.log"), lambda: port_open(port))
    return _with_value(proc, port)


def start_litellm(folder: Path, config: Path, logs: Path) -> contextlib.AbstractContextManager[Any]:
    port = free_port()
    env = child_env(
        LITELLM_LOCAL_MODEL_COST_MAP="True",  # no fetch of the cost map from the internet
        LITELLM_TELEMETRY="False", PYTHONPATH=str(folder), DISABLE_ADMIN_UI="True",
    )  # fmt: skip
    env.pop("DATABASE_URL", None)
    cmd = [str(ensure_litellm() / "bin" / "litellm"), "--config", str(config), "--host",
           "127.0.0.1", "--port", str(port), "--num_workers", "1"]  # fmt: skip
    health = f"http://127.0.0.1:{port}/health/liveliness"
    log = Path(f"{logs}-litellm.log")
    proc = Proc("litellm", cmd, log, lambda: http_ok(health), timeout=180, env=env, cwd=folder)
    return _with_value(proc, port)


def start_nginx(
    folder: Path, upstream: int, buffering: str, logs: Path
) -> contextlib.AbstractContextManager[Any]:
    port = free_port()
    cert, cert_key = self_signed_cert(folder)
    conf = nginx_config(folder, port, upstream, cert, cert_key, buffering)
    nginx = ensure_debian("nginx", "nginx")
    cmd = [nginx, "-c", str(conf), "-p", str(folder), "-e", str(folder / "error.log")]
    url = f"https://127.0.0.1:{port}"
    proc = Proc(
        "nginx", cmd, Path(f"{logs}-nginx.log"), lambda: http_ok(url + "/health/liveliness")
    )
    return _with_value(proc, url)


@contextlib.contextmanager
def _with_value(proc: Proc, value: Any) -> Iterator[tuple[Proc, Any]]:
    with proc:
        yield proc, value


def litellm_config(
    folder: Path, upstream_port: int, redis_port: int, key: str, model_name: str,
    response_cache: bool,
) -> Path:  # fmt: skip
    """config.yaml (JSON is YAML), and the custom-auth module with its key table."""
    redis = {"host": "127.0.0.1", "port": redis_port}
    settings: dict[str, Any] = {
        "max_budget": BUDGET_USD, "budget_duration": "30d", "request_timeout": 600,
        "enable_post_custom_auth_checks": True,
    }  # fmt: skip
    if response_cache:
        settings |= {"cache": True, "cache_params": {"type": "redis", **redis}}
    params = {
        "model": f"openai/{model_name}", "api_base": f"http://127.0.0.1:{upstream_port}/v1",
        "api_key": "none", "rpm": RPM, "tpm": TPM, "input_cost_per_token": 1e-7,
        "output_cost_per_token": 2e-7,
    }  # fmt: skip
    config = {
        "model_list": [{"model_name": model_name, "litellm_params": params}],
        "litellm_settings": settings,
        "router_settings": {"redis_host": "127.0.0.1", "redis_port": redis_port},
        "general_settings": {
            "master_key": "sk-bench-master",
            "custom_auth": "custom_auth.user_api_key_auth",
            "custom_auth_run_common_checks": True,
        },
    }
    limits = {
        "key_alias": "bench", "rpm_limit": RPM, "tpm_limit": TPM,
        "max_parallel_requests": CONCURRENCY, "max_budget": BUDGET_USD, "spend": 0.0,
        "models": [model_name],
    }  # fmt: skip
    (folder / "keys.json").write_text(json.dumps({key: limits}))
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
    temp_paths = "\n".join(f"    {sub}_temp_path {folder}/{sub};" for sub in
                           ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))  # fmt: skip
    text = f"""\
worker_processes auto;
daemon off;
pid {folder}/nginx.pid;
error_log {folder}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log {folder}/access.log;
{temp_paths}
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
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(san, critical=False).sign(key, hashes.SHA256())
    )  # fmt: skip
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )  # fmt: skip
    key_path.write_bytes(pem)
    return cert_path, key_path
