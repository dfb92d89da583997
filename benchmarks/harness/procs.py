"""Processes a benchmark starts: one server in a session of its own, and the machine's quiet.

A `Proc` starts its command in a new session (Ctrl-C reaches only the benchmark, which then
stops it), writes its output to a log, waits until `ready()` holds, and on exit stops its
whole process group (SIGTERM, then SIGKILL), so that an engine's child processes go with it.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import psutil
from _procstat import machine_busy_s, tree

BUSY_LOOP = [sys.executable, "-c", "while True: pass"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def http_ok(url: str, timeout: float = 1.0, headers: Mapping[str, str] | None = None) -> bool:
    """Whether GET `url` answers 200 (certificates unchecked: the benchmarks' own TLS)."""
    context = ssl._create_unverified_context()
    try:
        request = urllib.request.Request(url, headers=dict(headers or {}))
        with urllib.request.urlopen(request, timeout=timeout, context=context) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class Proc:
    """`cmd` as a server: logging to `log`, ready once `ready()` is true (within `timeout`
    seconds); a context manager."""

    def __init__(
        self, name: str, cmd: list[str], log: Path, ready: Callable[[], bool],
        timeout: float = 300.0, env: Mapping[str, str] | None = None, cwd: Path | None = None,
    ) -> None:  # fmt: skip
        self.name, self.cmd, self.log, self.ready = name, cmd, log, ready
        self.timeout, self.env, self.cwd = timeout, env, cwd
        self.start_s = 0.0

    def __enter__(self) -> Proc:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                self.cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env=None if self.env is None else dict(self.env), cwd=self.cwd,
            )  # fmt: skip
        try:
            self._wait_ready(start)
        except BaseException:
            self.__exit__()
            raise
        self.start_s = time.monotonic() - start
        print(f"  {self.name} ready in {self.start_s:.1f}s (pid {self.pid})", flush=True)
        return self

    def start(self) -> Proc:
        """Start it outside a `with` block (then `stop()` it)."""
        return self.__enter__()

    def stop(self) -> None:
        self.__exit__()

    def _wait_ready(self, start: float) -> None:
        while not self.ready():
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited early; log: {self.log}")
            if time.monotonic() - start > self.timeout:
                raise RuntimeError(f"{self.name} not ready in {self.timeout:.0f}s: {self.log}")
            time.sleep(0.25)

    @property
    def pid(self) -> int:
        return self.process.pid

    def children(self) -> list[int]:
        """Every process under this one, read when asked (an engine starts after its front)."""
        return tree(self.pid)[1:]

    def kill_group(self, wait: float = 10.0) -> list[int]:
        """SIGKILL to the whole process group (a crash of every process at once); the pids it
        held, once all are gone."""
        pids = tree(self.pid)
        os.killpg(self.pid, signal.SIGKILL)
        self.process.wait()
        deadline = time.monotonic() + wait
        while any(psutil.pid_exists(p) for p in pids[1:]) and time.monotonic() < deadline:
            time.sleep(0.05)
        if left := [p for p in pids[1:] if psutil.pid_exists(p)]:
            raise RuntimeError(f"processes {left} outlived kill -9 of {self.name}'s group")
        return pids

    def command(self) -> str:
        return shlex.join(self.cmd)

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(30)
        # Children that outlived their leader (the session's group): make sure they go.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)


def wait_quiet(max_wait: float, window: float = 3.0, busy: float = 0.2) -> float:
    """Wait up to `max_wait` s for a `window` in which the machine used under `busy` cores:
    on a shared 2-core machine another job on one core slows a run down many times. Returns
    the cores busy in the last window (0 without waiting)."""
    if max_wait <= 0:
        return 0.0
    deadline = time.monotonic() + max_wait
    while True:
        before, start = machine_busy_s(), time.monotonic()
        time.sleep(window)
        cores = (machine_busy_s() - before) / (time.monotonic() - start)
        if cores < busy or time.monotonic() >= deadline:
            if cores >= busy:
                print(f"  ! the machine stayed busy ({cores:.2f} cores); measuring anyway")
            return cores


@contextlib.contextmanager
def busy_loop(on: bool) -> Iterator[list[int]]:
    """With `on`, one busy-looping Python process (no CPU affinity) for the duration: its pid
    in a list; else nothing runs and the list is empty."""
    if not on:
        yield []
        return
    process = subprocess.Popen(BUSY_LOOP)
    try:
        yield [process.pid]
    finally:
        process.kill()
        process.wait()


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt, as Ctrl-C does, so that the `with` blocks stop every
    server (each runs in a session of its own, which a signal to this program never reaches).
    Inside the load client's event loop SIGINT cancels the run; a SystemExit raised from a
    handler there would be lost."""
    previous = signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
