"""Run `zerohop serve` as a real subprocess for API tests, on ports the server binds itself
(`--port 0 --grpc-port auto`) and reports in its `--port-file`: no port is picked here and
then bound there, so two servers cannot race for one. Each inherits the environment, with the
ZEROHOP_ERROR_RECORD file conftest checks every error body in (tests/error_bodies.py)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

if TYPE_CHECKING:
    from zerohop.client import ReplicaPool

MODEL_NAME = "tiny-llama"
FAST_LOOP_ENV = "ZEROHOP_TEST_FAST"  # set by `make test-fast`: no test here starts a server
SLOW_STOP = 10.0  # seconds: a stop that takes longer is warned about (idle: ~1.3 s here)


def free_port() -> int:
    """A port nothing listens on now, for a client that must find it closed. A server should
    bind port 0 itself and report what it got, not listen on this (another may take it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    model_dir: Path | None  # None: no MODEL argument, the default model (as `make run`)
    extra_args: list[str] = field(default_factory=list)
    served_model_name: str | None = MODEL_NAME
    extra_env: dict[str, str] = field(default_factory=dict)
    port: int = 0  # the ports the server bound, read from its --port-file by start()
    grpc_port: int | None = None  # None: no gRPC server (extra_args has --grpc-port 0)
    process: subprocess.Popen | None = None
    log_path: Path | None = None
    port_file: Path | None = None

    @property
    def url(self) -> str:
        scheme = "https" if "--tls-cert" in self.extra_args else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    def start(self, log_path: Path, timeout: float = 120.0) -> LiveServer:
        if os.environ.get(FAST_LOOP_ENV) == "1":
            pytest.fail(
                "this test starts `zerohop serve`, but tests/conftest.py did not mark it `server`:"
                " start it through LiveServer/serve_on/started_together/fleet_of in the test or a"
                " fixture, or mark the module `pytestmark = pytest.mark.server`"
            )
        self.log_path = log_path
        model = [] if self.model_dir is None else [str(self.model_dir)]
        name = (
            []
            if self.served_model_name is None
            else ["--served-model-name", self.served_model_name]
        )
        self.port_file = log_path.with_name(log_path.stem + ".ports.json")
        self.port_file.unlink(missing_ok=True)
        self.port, self.grpc_port = 0, None
        cmd = [
            sys.executable, "-m", "zerohop", "serve", *model, *name,
            "--port", "0", "--grpc-port", "auto", "--port-file", str(self.port_file),
            "--num-threads", "1", "--num-kv-blocks", "256", "--max-num-batched-tokens", "256",
            *self.extra_args,
        ]  # fmt: skip
        # Its own data folder (key store, ledger, audit log), not the user's.
        data = str(log_path.parent / "data")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "XDG_DATA_HOME": data, **self.extra_env}
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log()}")
            if not self.port_file.exists():  # written once both servers listen
                time.sleep(0.1)
                continue
            if not self.port:
                ports = json.loads(self.port_file.read_text())
                self.port, self.grpc_port = ports["http"], ports["grpc"]
            try:
                ready = httpx.get(self.url + "/ready", timeout=1.0, verify=False)
                if ready.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else None
        started = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        took = time.monotonic() - started
        if took > SLOW_STOP:  # said, so that a suite's lost half-minute has a name
            warnings.warn(
                f"`zerohop serve` took {took:.0f} s to exit after SIGTERM (exit {code}): a"
                f" stream a test left open drains for --drain-seconds; see {self.log_path}",
                stacklevel=2,
            )
        return code


@contextmanager
def fleet_of(
    model_dir: Path, store_url: str, args: list[list[str]], folder: Any
) -> Iterator[list[LiveServer]]:
    """One replica per `args` entry on the fleet store `store_url` (ZEROHOP_STORE), started
    one after another (model loads at once would only share the cores), each logging into a
    folder of its own from `folder()`; all stopped at the end."""
    servers = [LiveServer(model_dir, a, extra_env={"ZEROHOP_STORE": store_url}) for a in args]
    try:
        for server in servers:
            server.start(folder() / "server.log")
        yield servers
    finally:
        for server in servers:
            server.stop()


def with_chat_template(model_dir: Path, folder: Path, template: str) -> Path:
    """`folder`: a copy of the model folder whose chat template is `template`."""
    shutil.copytree(model_dir, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return folder


@contextmanager
def started_together(
    model_dir: Path, specs: dict[str, list[str]], tmp_path_factory: Any
) -> Iterator[dict[str, LiveServer]]:
    """Start one server per `specs` entry (name -> extra args) in parallel, stop them all.

    A start-up failure is raised on the caller's thread once every start has returned."""
    started: dict[str, LiveServer | BaseException] = {}

    def start(name: str) -> None:
        try:
            log = tmp_path_factory.mktemp(name) / "server.log"
            started[name] = LiveServer(model_dir, specs[name]).start(log)
        except BaseException as exc:
            started[name] = exc

    threads = [threading.Thread(target=start, args=(name,)) for name in specs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        for value in started.values():
            if isinstance(value, BaseException):
                raise value
        yield started  # type: ignore[misc]  # every value is a LiveServer here
    finally:
        for value in started.values():
            if isinstance(value, LiveServer):
                value.stop()


async def engine_has(client: httpx.AsyncClient, running: int, waiting: int) -> None:
    """Wait until the engine's own counters (GET /engine/stats) say so."""
    deadline = time.monotonic() + 60  # a safety net only
    while True:
        stats = (await client.get("/engine/stats")).json()
        if (stats["num_running"], stats["num_waiting"]) == (running, waiting):
            return
        assert time.monotonic() < deadline, stats
        await asyncio.sleep(0.02)


def kill_busy(pool: ReplicaPool, fleet: list[LiveServer]) -> str:
    """SIGKILL the replica of `fleet` answering the one request `pool` has in flight; its URL."""
    busy = [s for s in fleet if pool.replicas[s.url].in_flight]
    assert len(busy) == 1, pool.stats()
    assert busy[0].process is not None
    busy[0].process.kill()
    return busy[0].url
