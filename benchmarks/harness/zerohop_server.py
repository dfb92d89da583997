"""`zerohop serve` as a benchmark runs it: a subprocess on 127.0.0.1 and a free port, from
this checkout or a baseline tree, ready once /ready answers 200; its API process (the serve
process itself) and its engine process; a key store with one generous key.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from _procstat import children

from harness.ab import CURRENT, Tree
from harness.peers import child_env
from harness.procs import Proc, free_port, http_ok

SERVED_MODEL_NAME = "bench"
# serve.py's engine options, the offline engine's (engine_throughput.load_engine).
ENGINE_FLAGS = ["--max-num-seqs", "64", "--kv-cache-memory", "2.0"]
# Limits on the benchmark's key and tenant: checked on every request, never refusing one.
RPM, TPM, CONCURRENCY, BUDGET_TOKENS = 1_000_000, 10**9, 1_000, 10**12


class ZerohopServer(Proc):
    """`zerohop serve [MODEL] FLAGS...` (no model: zerohop's default) from `tree`, no gRPC
    port, served as `served_name`, with `env` added to the environment."""

    def __init__(
        self, model: Path | str | None, flags: list[str], log: Path, tree: Tree = CURRENT,
        timeout: float = 600.0, served_name: str = SERVED_MODEL_NAME, **env: str,
    ) -> None:  # fmt: skip
        self.port = free_port()
        cmd = [sys.executable, "-m", "zerohop", "serve", *([] if model is None else [str(model)])]
        cmd += ["--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "--grpc-port", "0"]
        cmd += ["--served-model-name", served_name, *flags]
        super().__init__(
            f"zerohop ({tree.name})", cmd, log, lambda: http_ok(self.url + "/ready"),
            timeout=timeout, env=tree.env(**child_env(**env)), cwd=tree.path,
        )  # fmt: skip

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def api_pid(self) -> int:
        return self.pid

    def engine_pid(self) -> int | None:
        found = children(self.pid, marker="engine_process")
        return found[0] if found else None

    def pids(self) -> dict[str, list[int]]:
        """The API process, and the engine process (with its children, vLLM's among them)."""
        layers = {"api": [self.pid]}
        if engine := [p for p in self.children() if p != self.pid]:
            layers["engine"] = engine
        return layers

    def output_tokens(self) -> float:
        return metric_total(self.url + "/metrics", "zerohop_output_tokens_total")


def metric_total(url: str, name: str) -> float:
    """Every sample of counter `name` on a Prometheus page, summed."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(row.rsplit(" ", 1)[1])
        for row in text.splitlines()
        if row.startswith((name + "{", name + " "))
    )


def metric_by_label(url: str, name: str, label: str) -> dict[str, float]:
    """Counter or gauge `name` on a Prometheus page, summed by the value of `label`."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for row in text.splitlines():
        if row.startswith(name + "{") and f'{label}="' in row:
            labels, _, value = row.rpartition(" ")
            key = labels.split(f'{label}="', 1)[1].split('"', 1)[0]
            out[key] = out.get(key, 0.0) + float(value)
    return out


def make_key(db: Path, tenant: str = "bench") -> str:
    """A fresh key store at `db` with one tenant and one key, both with every limit and a
    budget, all too generous to refuse anything; returns the key."""
    zerohop = [sys.executable, "-m", "zerohop", "keys"]
    limits = ["--rpm", str(RPM), "--itpm", str(TPM), "--otpm", str(TPM)]
    limits += ["--max-concurrency", str(CONCURRENCY), "--budget", str(BUDGET_TOKENS)]
    db_arg = ["--keys-db", str(db)]
    subprocess.run([*zerohop, "tenant", tenant, *limits, *db_arg], check=True, capture_output=True)
    create = [*zerohop, "create", "--tenant", tenant, "--name", "bench", *limits, "--json"]
    out = subprocess.run([*create, *db_arg], check=True, capture_output=True)
    key: str = json.loads(out.stdout)["key"]
    return key


def gateway_flags(folder: Path) -> tuple[list[str], str]:
    """The flags of a server with its gateway on (a fresh key store and audit folder in
    `folder`), and the key to send."""
    db = folder / "keys.db"
    key = make_key(db)
    return ["--keys-db", str(db), "--audit-dir", str(folder / "audit")], key
