"""A real PostgreSQL server for tests: `initdb` in a temporary folder of its own, `postgres`
listening on a unix socket in that folder and on 127.0.0.1, trust authentication, no mocks.

    with PostgresServer() as pg:
        psycopg.connect(pg.url)  # postgresql://postgres@127.0.0.1:PORT/postgres
        pg.kill()                # SIGKILL to the whole server: an outage, then crash recovery
        pg.start()               # the same data folder and port again

The binaries come from Debian's `postgresql` package (/usr/lib/postgresql/N/bin; `make test`
installs it when absent, scripts/ensure_postgres.sh) or from PATH. PostgreSQL refuses to run
as root, so as root both programs run as the package's `postgres` user (or `nobody`), which
owns the temporary folder. `require_postgres()` skips a test where PostgreSQL is missing, or
fails it where ZEROHOP_REQUIRE_POSTGRES=1 (CI, .ci/run), so CI never passes by skipping.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import psycopg

REQUIRE_ENV = "ZEROHOP_REQUIRE_POSTGRES"
SUPERUSER = "postgres"  # the role initdb creates; trust authentication, no password
# Small and quick, but durable: fsync and synchronous_commit stay at their defaults, so a
# kill() loses nothing a client saw committed.
SETTINGS = {
    "listen_addresses": "127.0.0.1",
    "shared_buffers": "16MB",
    "max_connections": "100",
    "max_wal_size": "64MB",
    "huge_pages": "off",
}


def bin_dir() -> Path | None:
    """The folder holding initdb and postgres: Debian's newest version, else PATH's."""
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=_version, reverse=True)
    for folder in versions:
        if (folder / "initdb").is_file() and (folder / "postgres").is_file():
            return folder
    found = shutil.which("initdb")
    return Path(found).resolve().parent if found else None


def _version(folder: Path) -> float:
    try:
        return float(folder.parent.name)
    except ValueError:
        return 0.0


def require_postgres() -> Path:
    """bin_dir(), or skip the test (fail it where ZEROHOP_REQUIRE_POSTGRES=1)."""
    import pytest

    found = bin_dir()
    if found is None:
        reason = (
            "PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb nor initdb on "
            "PATH): `make test` installs Debian's postgresql package where apt-get can"
        )
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{reason} ({REQUIRE_ENV}=1)")
        pytest.skip(reason)
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_as() -> pwd.struct_passwd | None:
    """The unprivileged account to run PostgreSQL as when we are root; None when not root."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise RuntimeError("running as root and no `postgres` or `nobody` user to run PostgreSQL as")


def _live_processes() -> list[tuple[int, int, int]]:
    """(pid, ppid, pgrp) of every process that is not a zombie (Linux /proc). Zombies do not
    count: they hold no shared memory, and a PID 1 that never reaps (some containers) would
    keep them forever."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError):
            # "pid (comm) state ppid pgrp ...": comm may hold spaces, so split after ")"
            fields = stat.read_text().rpartition(")")[2].split()
            if fields[0] != "Z":
                found.append((int(stat.parent.name), int(fields[1]), int(fields[2])))
    return found


def _family_alive(postmaster: int, children: set[int]) -> bool:
    """Whether the postmaster's process group or any of its `children` still runs."""
    if not Path("/proc").is_dir():  # not Linux: signal 0 (counts zombies)
        try:
            os.killpg(postmaster, 0)
        except ProcessLookupError:
            return False
        return True
    return any(pgrp == postmaster or pid in children for pid, _, pgrp in _live_processes())


class PostgresServer:
    """One PostgreSQL cluster in a temporary folder; `start()` again after `stop()`/`kill()`
    reuses its data folder and port, so `url` stays valid."""

    def __init__(self, bin_path: Path | None = None, start_timeout: float = 30.0) -> None:
        self.bin = bin_path or require_postgres()
        self.start_timeout = start_timeout
        self.user = _run_as()
        self.root = Path(tempfile.mkdtemp(prefix="zerohop-pg-"))
        self.data = self.root / "data"
        self.socket_dir = self.root / "socket"
        self.log_path = self.root / "postgres.log"
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._prepare_root()

    @property
    def url(self) -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/postgres"

    @property
    def socket_url(self) -> str:
        """The same server through its unix socket (no TCP)."""
        return f"postgresql://{SUPERUSER}@/postgres?host={self.socket_dir}&port={self.port}"

    def __enter__(self) -> PostgresServer:
        try:
            self.initdb()
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _prepare_root(self) -> None:
        self.socket_dir.mkdir()
        self.log_path.touch()
        if self.user is not None:
            for path in (self.root, self.socket_dir, self.log_path):
                os.chown(path, self.user.pw_uid, self.user.pw_gid)

    def _popen_args(self) -> dict[str, Any]:
        """Popen arguments that drop root for the package's user (no supplementary groups)."""
        args: dict[str, Any] = {"cwd": self.root, "env": {**os.environ, "LC_ALL": "C"}}
        if self.user is not None:
            args |= {"user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": []}
            args["env"] |= {"HOME": str(self.root), "USER": self.user.pw_name}
        return args

    def initdb(self) -> None:
        """A new cluster in the data folder: UTF8, C locale (no locale warnings), trust auth.
        --no-sync skips only initdb's own final flush; the server itself keeps fsync on."""
        cmd = [
            str(self.bin / "initdb"), "-D", str(self.data), "-U", SUPERUSER,
            "--auth=trust", "--encoding=UTF8", "--no-locale", "--no-sync", "--no-instructions",
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, **self._popen_args())
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed ({done.returncode}):\n{done.stdout}{done.stderr}")

    def start(self) -> PostgresServer:
        """Start the server on the data folder (crash recovery after kill()); wait until it
        accepts connections. The first start picks a free port, later ones reuse it."""
        if self.running:
            raise RuntimeError("PostgreSQL is already running")
        first = self.port == 0
        for _attempt in range(5 if first else 1):
            if first:
                self.port = _free_port()  # postgres cannot bind port 0: retried if taken
            if self._start_once():
                return self
        raise RuntimeError(f"PostgreSQL could not bind port {self.port}:\n{self.log()}")

    def _start_once(self) -> bool:
        """True once ready; False where the port was taken; raises on any other failure."""
        settings = [f"-c{name}={value}" for name, value in SETTINGS.items()]
        cmd = [
            str(self.bin / "postgres"), "-D", str(self.data), "-p", str(self.port),
            "-k", str(self.socket_dir), *settings,
        ]  # fmt: skip
        offset = self.log_path.stat().st_size
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                **self._popen_args(),
            )  # fmt: skip
        try:
            return self._wait_ready(offset)
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self, log_offset: int) -> bool:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                if "already in use" in self.log()[log_offset:]:
                    return False
                raise RuntimeError(f"postgres exited ({self.process.returncode}):\n{self.log()}")
            with contextlib.suppress(psycopg.OperationalError):
                psycopg.connect(self.url, connect_timeout=2).close()
                return True
            time.sleep(0.05)
        raise RuntimeError(f"PostgreSQL not ready after {self.start_timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 30.0) -> None:
        """A fast shutdown (SIGINT): clients are disconnected, everything is flushed."""
        if not self.running:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL to the server and every backend, as a crash would; the next start() runs
        crash recovery. Returns once none of them is left. Backends are not in the server's
        process group (each calls setsid()), so they are found as its children: left alone,
        one outlives the server for a moment and still answers its client."""
        if self.process is None:
            return
        postmaster = self.process.pid
        children = {pid for pid, ppid, _ in _live_processes() if ppid == postmaster}
        with contextlib.suppress(ProcessLookupError):
            os.killpg(postmaster, signal.SIGKILL)
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        self.process.wait()
        self._wait_gone(postmaster, children)

    @staticmethod
    def _wait_gone(postmaster: int, children: set[int], timeout: float = 10.0) -> None:
        # Backends still attached to the old shared memory would make the next start refuse.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not _family_alive(postmaster, children):
                return
            time.sleep(0.01)
        raise RuntimeError(f"PostgreSQL processes of server {postmaster} outlived SIGKILL")

    def close(self) -> None:
        """Stop the server and delete its folder."""
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
