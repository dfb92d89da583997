"""A failed `zerohop` command says why in one line on stderr and exits 1, no traceback:
a start-up refusal (a second replica on a taken audit directory) and the tools' failures
(`keys`, `audit`, `bench`, `probe`), each run as a real subprocess."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.live_server import LiveServer, free_port
from zerohop.cli.errors import TRACEBACK_ENV, failure_line


def zerohop(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "zerohop", *argv]
    environ = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(command, capture_output=True, text=True, timeout=180, env=environ)


def one_line(done: subprocess.CompletedProcess, *words: str, prefix: str = "zerohop: ") -> str:
    """The one `zerohop: ...` line a failed command ends with, checked for `words`."""
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(prefix), done.stderr
    for word in words:
        assert word in line, line
    return line


def test_a_second_replica_on_a_taken_audit_directory_is_refused_in_one_line(
    llama_dir: Path, tmp_path: Path
) -> None:
    first = LiveServer(llama_dir, ["--grpc-port", "0"]).start(tmp_path / "first.log")
    try:
        # The same data folder (key store and audit log) as the first replica.
        data = {"XDG_DATA_HOME": str(tmp_path / "data")}
        args = ["serve", str(llama_dir), "--port", "0", "--grpc-port", "0", "--num-threads", "1"]
        second = zerohop(*args, "--num-kv-blocks", "64", env=data)
        audit = tmp_path / "data" / "zerohop" / "audit"
        one_line(second, str(audit), "in use by another audit log")
        assert first.process.poll() is None  # the first replica goes on serving
    finally:
        assert first.stop() == 0


def test_keys_on_a_store_it_cannot_open(tmp_path: Path) -> None:
    not_a_db = tmp_path / "keys.db"
    not_a_db.write_text("not a database\n")
    listed = zerohop("keys", "list", "--keys-db", str(not_a_db))
    one_line(listed, f"the key store {not_a_db}", "not a database")
    nowhere = tmp_path / "missing" / "deeper" / "keys.db"
    nowhere.parent.parent.mkdir()
    nowhere.parent.parent.chmod(0o500)  # cannot create `deeper` in it
    try:
        created = zerohop("keys", "create", "--tenant", "a", "--keys-db", str(nowhere))
    finally:
        nowhere.parent.parent.chmod(0o700)
    if os.geteuid() != 0:  # root may write anywhere
        one_line(created, "keys.db")


def test_audit_verify_on_a_file(tmp_path: Path) -> None:
    a_file = tmp_path / "audit"
    a_file.write_text("")
    done = zerohop("audit", "verify", str(a_file), env={"XDG_DATA_HOME": str(tmp_path)})
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert str(a_file) in done.stderr.strip().splitlines()[-1]


def test_bench_failures(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    one_line(zerohop("bench", "--url", url, "--num-requests", "1", "--no-progress"), "127.0.0.1")
    missing = tmp_path / "run.json"
    one_line(zerohop("bench", "compare", str(missing)), str(missing), "No such file")
    missing.write_text("{")
    one_line(zerohop("bench", "compare", str(missing)), str(missing), "not a saved bench run")


def test_probe_of_a_closed_port() -> None:
    port = free_port()
    done = zerohop("probe", f"http://127.0.0.1:{port}")
    one_line(done, f"127.0.0.1:{port}", "refused", prefix="zerohop probe: ")


@pytest.mark.parametrize(
    ("error", "line"),
    [
        (sqlite3.OperationalError("unable to open database file"), "the key store /k.db: unable"),
        (FileNotFoundError(2, "No such file or directory", "/x.json"), "/x.json: No such file"),
        (RuntimeError("/d/audit is in use\n by another audit log"), "/d/audit is in use by"),
        (ValueError("run.json: not a saved bench run"), "run.json: not a saved bench run"),
    ],
)
def test_failure_lines(error: Exception, line: str) -> None:
    assert failure_line(error, Path("/k.db")).startswith(line)


def test_bugs_keep_their_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    assert failure_line(KeyError("x")) is None
    assert failure_line(TypeError("x")) is None
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    assert failure_line(RuntimeError("x")) is None
