"""The audit log: hash chain, rotation, restarts, crashes, verify, and the request path;
the chain head recorded in the key store (a deleted tail is reported), and audit directory
failures on a real server (`--audit-failure open|closed`, real EFBIG from RLIMIT_FSIZE)."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.live_server import MODEL_NAME, LiveServer
from zerohop.cli import audit as audit_cli
from zerohop.gateway.audit import log as audit
from zerohop.gateway.audit.failure import AuditFailures
from zerohop.gateway.audit.log import CURRENT, ZERO_HASH, AuditLog, log_files, verify
from zerohop.gateway.store.audit_heads import AuditHeadRepository, ChainHead, read_head
from zerohop.gateway.store.spec import StoreSpec
from zerohop.gateway.store.store import Store

ROOT = Path(__file__).resolve().parent.parent


def entry(i: int, **extra: object) -> dict:
    return {"request_id": f"req-{i}", "key_id": "k1", "tenant": "t", "status": 200, **extra}


def write(directory: Path, n: int, start: int = 0, **kwargs: object) -> None:
    with AuditLog(directory, flush_interval=0.01, **kwargs) as log:
        for i in range(start, start + n):
            log.record(entry(i))


def lines(directory: Path) -> list[bytes]:
    out = []
    for path in log_files(directory):
        out += path.read_bytes().split(b"\n")[:-1]  # the last: b"" or a torn tail
    return out


def records(directory: Path) -> list[dict]:
    return [orjson.loads(ln) for ln in lines(directory)]


def test_chain_over_many_records(tmp_path: Path) -> None:
    write(tmp_path, 500)
    recs, raw = records(tmp_path), lines(tmp_path)
    assert [r["request_id"] for r in recs] == [f"req-{i}" for i in range(500)]
    assert [r["seq"] for r in recs] == list(range(500))
    assert recs[0]["prev"] == ZERO_HASH
    for line, rec in zip(raw, recs[1:], strict=False):
        assert rec["prev"] == hashlib.sha256(line).hexdigest()  # the line without its newline
    assert recs[0]["time"].endswith("Z") and "T" in recs[0]["time"]
    assert verify(tmp_path) == audit.VerifyResult(True, 500, 1, None, [])


def test_rotation_continues_the_chain(tmp_path: Path) -> None:
    write(tmp_path, 300, max_bytes=4096)
    files = log_files(tmp_path)
    assert len(files) > 5 and files[-1].name == CURRENT
    assert [p.name for p in files[:-1]] == sorted(p.name for p in files[:-1])
    assert all(p.stat().st_size <= 4096 for p in files)
    result = verify(tmp_path)
    assert result.ok and result.records == 300 and result.files == len(files)
    assert [r["seq"] for r in records(tmp_path)] == list(range(300))


def test_restart_continues_the_chain(tmp_path: Path) -> None:
    write(tmp_path, 50, max_bytes=2048)
    write(tmp_path, 50, start=50, max_bytes=2048)
    write(tmp_path, 0)  # a start and close with nothing to write
    assert verify(tmp_path).records == 100
    assert [r["request_id"] for r in records(tmp_path)] == [f"req-{i}" for i in range(100)]


def test_a_second_writer_on_the_same_directory_is_refused(tmp_path: Path) -> None:
    with AuditLog(tmp_path), pytest.raises(RuntimeError, match="in use"):
        AuditLog(tmp_path).start()


def test_torn_last_line_after_a_crash(tmp_path: Path) -> None:
    write(tmp_path, 10)
    with (tmp_path / CURRENT).open("ab") as f:
        f.write(b'{"request_id":"req-10","seq":10,"pr')  # cut mid-write
    torn = verify(tmp_path)
    assert torn.ok and torn.records == 10 and torn.torn == [f"{CURRENT} line 11"]
    write(tmp_path, 5, start=10)
    files = log_files(tmp_path)
    assert len(files) == 2  # the torn file was rotated as it is, not rewritten
    assert files[0].read_bytes().endswith(b'"pr')
    result = verify(tmp_path)
    assert result.ok and result.records == 15 and len(result.torn) == 1
    assert [r["seq"] for r in records(tmp_path)] == list(range(15))


def test_verify_names_an_edited_record(tmp_path: Path) -> None:
    write(tmp_path, 20)
    path = tmp_path / CURRENT
    raw = path.read_bytes().split(b"\n")
    raw[7] = raw[7].replace(b'"status":200', b'"status":201')
    path.write_bytes(b"\n".join(raw))
    result = verify(tmp_path)
    assert not result.ok and result.records == 8
    assert result.first_broken.startswith(f"{CURRENT} line 8: edited")


def test_verify_names_a_deleted_record(tmp_path: Path) -> None:
    write(tmp_path, 20)
    path = tmp_path / CURRENT
    raw = path.read_bytes().split(b"\n")
    del raw[12]
    path.write_bytes(b"\n".join(raw))
    result = verify(tmp_path)
    assert not result.ok
    assert result.first_broken == (
        f"{CURRENT} line 13: seq 13: records 12 missing here (deleted or moved)"
    )


def test_verify_detects_a_deleted_record_with_renumbered_seq(tmp_path: Path) -> None:
    write(tmp_path, 6)
    recs = records(tmp_path)
    del recs[3]
    for i, rec in enumerate(recs):
        rec["seq"] = i
    (tmp_path / CURRENT).write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs))
    result = verify(tmp_path)
    assert not result.ok and result.first_broken.startswith(f"{CURRENT} line 3: edited")


def test_verify_detects_reordered_lines_and_files(tmp_path: Path) -> None:
    write(tmp_path, 10)
    path = tmp_path / CURRENT
    raw = path.read_bytes().split(b"\n")
    raw[4], raw[5] = raw[5], raw[4]
    path.write_bytes(b"\n".join(raw))
    assert verify(tmp_path).first_broken.startswith(f"{CURRENT} line 5: seq 5")

    other = tmp_path / "rot"
    write(other, 100, max_bytes=2048)
    first, second = log_files(other)[:2]
    a, b = first.read_bytes(), second.read_bytes()
    first.write_bytes(b)
    second.write_bytes(a)
    result = verify(other)
    assert not result.ok and result.first_broken.startswith(f"{first.name} line 1:")


def test_verify_detects_a_deleted_rotated_file_unless_trusting_the_first(tmp_path: Path) -> None:
    write(tmp_path, 100, max_bytes=2048)
    files = log_files(tmp_path)
    files[0].unlink()
    seq = records(tmp_path)[0]["seq"]
    assert verify(tmp_path).first_broken == (
        f"{files[1].name} line 1: seq {seq}: records 0..{seq - 1} missing here (deleted or moved)"
    )
    assert verify(tmp_path, trust_first=True).ok  # retention removed the oldest file
    files[2].unlink()
    assert not verify(tmp_path, trust_first=True).ok


def test_verify_rejects_a_record_that_is_not_json(tmp_path: Path) -> None:
    write(tmp_path, 3)
    with (tmp_path / CURRENT).open("ab") as f:
        f.write(b"garbage\n")
    assert verify(tmp_path).first_broken == f"{CURRENT} line 4: not a JSON record"


def test_content_only_with_include_content(tmp_path: Path) -> None:
    with AuditLog(tmp_path / "off") as log:
        assert not log.include_content
        log.record(entry(1, prompt="secret prompt", output="secret answer"))
    with AuditLog(tmp_path / "on", include_content=True) as log:
        assert log.include_content
        log.record(entry(1, prompt="the prompt", output="the answer"))
    off = records(tmp_path / "off")[-1]
    on = records(tmp_path / "on")[-1]
    assert "prompt" not in off and "output" not in off
    assert b"secret" not in (tmp_path / "off" / CURRENT).read_bytes()
    assert (on["prompt"], on["output"]) == ("the prompt", "the answer")


def test_unserializable_values_do_not_stop_the_writer(tmp_path: Path) -> None:
    with AuditLog(tmp_path) as log:
        log.record(entry(0, extra=object(), path=Path("/x"), ids={1: 2}))
        log.record(entry(1, big=2**70))
        log.record(entry(2))
    recs = records(tmp_path)
    assert len(recs) == 3 and recs[0]["path"] == "/x" and recs[0]["ids"] == {"1": 2}
    assert "audit_error" in recs[1] and recs[2]["request_id"] == "req-2"
    assert verify(tmp_path).ok


class BlockedLog(AuditLog):
    """A writer whose first fsync waits until the test lets it go."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.in_fsync = threading.Event()
        self.release = threading.Event()

    def _sync(self, fd: int) -> None:
        self.in_fsync.set()
        assert self.release.wait(10)
        super()._sync(fd)


def test_record_never_waits_for_the_writer(tmp_path: Path) -> None:
    log = BlockedLog(tmp_path, flush_interval=0.01)
    log.start()
    log.record(entry(0))
    assert log.in_fsync.wait(5)  # the writer is now stuck in its disk write
    for i in range(1, 10_001):
        log.record(entry(i))
    assert log.written == 0 and not log.release.is_set()  # all returned while it was stuck
    log.release.set()
    log.close()
    assert log.written == 10_001
    assert verify(tmp_path).records == 10_001


def test_close_flushes_everything_and_twice_is_safe(tmp_path: Path) -> None:
    log = AuditLog(tmp_path, flush_interval=60)  # the writer would not wake on its own
    log.start()
    for i in range(1000):
        log.record(entry(i))
    log.close()
    log.close()
    assert verify(tmp_path).records == 1000
    log.record(entry(1000))
    assert log.dropped == 1 and verify(tmp_path).records == 1000


def test_close_without_start_writes_what_was_queued(tmp_path: Path) -> None:
    log = AuditLog(tmp_path)
    log.record(entry(0))
    log.close()
    assert verify(tmp_path).records == 1
    AuditLog(tmp_path / "never").close()
    assert not (tmp_path / "never").exists()


CHILD = """
import signal, sys, time
from pathlib import Path
from zerohop.gateway.audit.log import AuditLog
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
log = AuditLog(Path(sys.argv[1]), flush_interval=0.2, max_bytes=16384)
log.start()
i = 0
while True:
    log.record({"i": i, "request_id": f"req-{i}", "status": 200})
    print(i, time.time(), flush=True)
    i += 1
    time.sleep(0.002)
"""


def run_child(directory: Path, sig: int, seconds: float) -> tuple[list[float], float]:
    """Run CHILD for `seconds`, send `sig`; return each record's time and the signal's time."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(directory)], stdout=subprocess.PIPE, env=env
    )
    assert proc.stdout is not None
    times: list[float] = []
    first = None
    for line in proc.stdout:
        times.append(float(line.split()[1]))
        first = first or time.time()
        if time.time() - first >= seconds:
            break
    sent = time.time()
    proc.send_signal(sig)
    times += [float(line.split()[1]) for line in proc.stdout.read().splitlines()]
    proc.wait(10)
    return times, sent


def test_kill_9_loses_at_most_the_last_flush_interval(tmp_path: Path) -> None:
    times, killed = run_child(tmp_path, signal.SIGKILL, 1.0)
    result = verify(tmp_path)
    assert result.ok, result.first_broken
    on_disk = [r["i"] for r in records(tmp_path)]
    assert on_disk == list(range(len(on_disk)))  # a whole prefix
    assert len(on_disk) <= len(times) + 1  # at most the record queued before its print
    # Every record queued before the last flush interval (plus slack for a loaded machine:
    # the write in progress, scheduling) was durable when the process died.
    must = sum(t <= killed - 0.2 - 0.3 for t in times)
    assert must > 50 and len(on_disk) >= must, (len(on_disk), must, len(times))
    assert len(log_files(tmp_path)) > 1  # it rotated along the way

    write(tmp_path, 3)  # a restart continues the chain, torn tail or not
    assert verify(tmp_path).records == len(on_disk) + 3


def test_sigterm_flushes_everything(tmp_path: Path) -> None:
    times, _ = run_child(tmp_path, signal.SIGTERM, 0.3)
    result = verify(tmp_path)
    assert result.ok and not result.torn
    # The handler may run after a record() and before its print: one more on disk then.
    assert result.records in (len(times), len(times) + 1)


def verify_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerohop")
    audit_cli.add_audit_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def test_verify_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path, 30, max_bytes=2048)
    files = len(log_files(tmp_path))

    def run(*argv: str) -> int:
        args = verify_parser().parse_args(["audit", "verify", *argv])
        return args.func(args)

    assert run(str(tmp_path)) == 0
    assert capsys.readouterr().out == f"ok: 30 records in {files} files\n"
    path = tmp_path / CURRENT
    path.write_bytes(path.read_bytes().replace(b"200", b"500", 1))
    assert run(str(tmp_path)) == 1
    assert capsys.readouterr().out.startswith(f"broken: {CURRENT} line ")
    assert run(str(tmp_path / "missing")) == 2


def cli_has_audit() -> bool:
    from zerohop.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return "audit" in sub.choices


def test_zerohop_audit_verify_exit_codes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from zerohop.cli import main

    assert cli_has_audit(), "`zerohop audit` is not wired into zerohop.cli"
    write(tmp_path, 5)
    assert main(["audit", "verify", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "ok: 5 records in 1 files\n"
    raw = (tmp_path / CURRENT).read_bytes().split(b"\n")
    del raw[1]
    (tmp_path / CURRENT).write_bytes(b"\n".join(raw))
    cmd = [sys.executable, "-m", "zerohop", "audit", "verify", str(tmp_path)]
    bad = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert bad.returncode == 1
    assert bad.stdout == (
        f"broken: {CURRENT} line 2: seq 2: records 1 missing here (deleted or moved)\n"
    )


# -- the recorded chain head: a deleted tail is told ------------------------------------------


@contextlib.contextmanager
def heads_in(db: Path) -> Iterator[AuditHeadRepository]:
    """The chain heads of the store in `db`, as `zerohop serve` gives them to its audit log."""
    store = Store.of(StoreSpec.sqlite(db))
    try:
        yield store.audit_heads
    finally:
        store.close()


class CountingHeads:
    """A store's heads, counting what the writer saves."""

    def __init__(self, heads: AuditHeadRepository) -> None:
        self.heads, self.where = heads, heads.where
        self.saves: list[ChainHead] = []
        self.saved = threading.Event()

    def load(self, directory: Path) -> ChainHead | None:
        return self.heads.load(directory)

    def save(self, directory: Path, head: ChainHead) -> None:
        self.heads.save(directory, head)
        self.saves.append(head)
        self.saved.set()


def write_with_heads(directory: Path, db: Path, n: int, start: int = 0) -> None:
    with heads_in(db) as heads, AuditLog(directory, flush_interval=0.01, heads=heads) as log:
        for i in range(start, start + n):
            log.record(entry(i))


def drop_last_lines(path: Path, n: int) -> list[bytes]:
    raw = path.read_bytes().split(b"\n")[:-1]
    keep = len(raw) - n
    path.write_bytes(b"".join(line + b"\n" for line in raw[:keep]))
    return raw[keep:]


def test_close_records_the_chain_head_and_verify_checks_it(tmp_path: Path) -> None:
    log_dir, db = tmp_path / "audit", tmp_path / "keys.db"
    write_with_heads(log_dir, db, 10)
    head = read_head(db, log_dir)
    last = lines(log_dir)[-1]
    assert head is not None and (head.seq, head.file) == (9, CURRENT)
    assert head.hash == hashlib.sha256(last).hexdigest()
    assert verify(log_dir, head=head).ok

    [removed] = drop_last_lines(log_dir / CURRENT, 1)
    assert removed == last
    result = verify(log_dir, head=head)
    assert not result.ok and result.first_broken is None
    assert result.truncated == (
        f"the chain head recorded at {head.describe()} is missing; the log ends at record 8"
    )
    (log_dir / CURRENT).unlink()
    assert verify(log_dir, head=head).truncated.endswith("is missing; the log holds no records")


def test_verify_names_a_rewritten_head(tmp_path: Path) -> None:
    log_dir, db = tmp_path / "audit", tmp_path / "keys.db"
    write_with_heads(log_dir, db, 5)
    head = read_head(db, log_dir)
    recs = records(log_dir)
    recs[-1]["status"] = 500  # the last record rewritten: no later prev shows it
    (log_dir / CURRENT).write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs))
    assert verify(log_dir).ok  # the chain alone cannot tell
    result = verify(log_dir, head=head)
    assert not result.ok and "does not match record 4 of the log" in result.truncated


def test_the_head_is_recorded_while_writing_at_most_once_per_interval(tmp_path: Path) -> None:
    store = Store.of(StoreSpec.sqlite(tmp_path / "keys.db"))
    heads = CountingHeads(store.audit_heads)
    log = AuditLog(tmp_path / "audit", flush_interval=0.01, heads=heads, head_interval=3600)
    log.start()
    log.record(entry(0))
    assert heads.saved.wait(30)  # the first head at the first write, before any close
    assert [h.seq for h in heads.saves] == [0]
    for i in range(1, 6):  # five more flushes, each waited for
        log.record(entry(i))
        deadline = time.monotonic() + 30
        while log.written <= i and time.monotonic() < deadline:
            time.sleep(0.01)
    assert log.written == 6
    assert [h.seq for h in heads.saves] == [0]  # not again within the interval
    log.close()
    assert [h.seq for h in heads.saves] == [0, 5]  # and at close, the final head
    store.close()


def test_a_restart_after_a_truncation_keeps_the_gap(tmp_path: Path) -> None:
    log_dir, db = tmp_path / "audit", tmp_path / "keys.db"
    write_with_heads(log_dir, db, 6)
    drop_last_lines(log_dir / CURRENT, 2)  # records 4 and 5 deleted
    write_with_heads(log_dir, db, 2, start=6)  # restarted: continues after record 5
    assert [r["seq"] for r in records(log_dir)] == [0, 1, 2, 3, 6, 7]
    result = verify(log_dir, head=read_head(db, log_dir))
    assert result.first_broken == (
        f"{CURRENT} line 5: seq 6: records 4..5 missing here (deleted or moved)"
    )


# -- several directories: a fleet's replicas' audit folders gathered in one place -------------


def replica(root: Path, name: str, n: int) -> Path:
    """A replica's data folder as `zerohop serve` lays it out: audit/ and keys.db beside."""
    write_with_heads(root / name / "audit", root / name / "keys.db", n)
    return root / name / "audit"


def verify_cli(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    from zerohop.cli import main

    code = main(["audit", "verify", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def no_default_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """$XDG_DATA_HOME/zerohop/keys.db (the last place looked in) is this test's own."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))


def test_verify_of_two_good_directories_prefixes_each_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_default_store: None
) -> None:
    a = replica(tmp_path, "zerohop-0", 5)
    b = replica(tmp_path, "zerohop-1", 7)
    code, out, err = verify_cli(capsys, a, b)
    assert (code, err) == (0, "")  # each head found beside its own folder
    assert out == f"{a}: ok: 5 records in 1 files\n{b}: ok: 7 records in 1 files\n"


def test_verify_of_several_directories_names_the_broken_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_default_store: None
) -> None:
    a, b, c = (replica(tmp_path, f"zerohop-{i}", 4) for i in range(3))
    drop_last_lines(b / CURRENT, 1)  # b's newest record deleted: only its own head tells
    head = read_head(tmp_path / "zerohop-1" / "keys.db", b)
    code, out, _ = verify_cli(capsys, a, b, c)
    assert code == 1
    assert out.splitlines() == [
        f"{a}: ok: 4 records in 1 files",
        f"{b}: truncated: the chain head recorded at {head.describe()} is missing;"
        " the log ends at record 2",
        f"{c}: ok: 4 records in 1 files",
    ]
    path = c / CURRENT
    path.write_bytes(path.read_bytes().replace(b"200", b"500", 1))
    code, out, _ = verify_cli(capsys, a, c)
    assert code == 1
    assert out.startswith(f"{a}: ok: 4 records in 1 files\n{c}: broken: {CURRENT} line ")


def test_verify_of_several_directories_with_a_missing_one_checks_the_others(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_default_store: None
) -> None:
    a, b = replica(tmp_path, "zerohop-0", 3), replica(tmp_path, "zerohop-1", 3)
    raw = (b / CURRENT).read_bytes().split(b"\n")
    del raw[1]
    (b / CURRENT).write_bytes(b"\n".join(raw))
    missing = tmp_path / "zerohop-2" / "audit"
    cmd = [sys.executable, "-m", "zerohop", "audit", "verify", str(a), str(missing), str(b)]
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "xdg")}
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert run.returncode == 2  # the worst: 2 (missing) > 1 (broken) > 0
    assert run.stdout == (
        f"{a}: ok: 3 records in 1 files\n"
        f"{b}: broken: {CURRENT} line 2: seq 2: records 1 missing here (deleted or moved)\n"
    )
    assert run.stderr == f"zerohop audit verify: {missing}: not a directory\n"


def test_keys_db_is_refused_with_several_directories(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = replica(tmp_path, "zerohop-0", 2), replica(tmp_path, "zerohop-1", 2)
    code, out, err = verify_cli(capsys, a, b, "--keys-db", tmp_path / "zerohop-0" / "keys.db")
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("zerohop audit verify: --keys-db ")
    code, out, _ = verify_cli(capsys, a, "--keys-db", tmp_path / "zerohop-0" / "keys.db")
    assert (code, out) == (0, "ok: 2 records in 1 files\n")  # one DIR: as before


def test_gathered_folders_are_checked_against_the_head_recorded_where_they_were(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_default_store: None
) -> None:
    # Each replica recorded its head under its own path (/var/lib/zerohop/audit in a pod);
    # `kubectl cp` brings the data folder, keys.db included, somewhere else.
    pods, gathered = tmp_path / "pods", tmp_path / "gathered"
    for i in range(2):
        replica(pods / f"node-{i}", "data", 4 + i)
    gathered.mkdir()
    a, b = (
        (pods / f"node-{i}" / "data").rename(gathered / f"zerohop-{i}") / "audit" for i in range(2)
    )
    code, out, err = verify_cli(capsys, a, b)
    assert code == 0 and out == f"{a}: ok: 4 records in 1 files\n{b}: ok: 5 records in 1 files\n"
    was = pods / "node-1" / "data" / "audit"
    assert f"{b}: note: using the chain head {b.parent / 'keys.db'} recorded for {was}" in err

    drop_last_lines(b / CURRENT, 2)  # the copy lost its tail: told, moved or not
    code, out, _ = verify_cli(capsys, a, b)
    assert code == 1 and out.splitlines()[1].startswith(f"{b}: truncated: the chain head")
    assert out.splitlines()[1].endswith("is missing; the log ends at record 2")

    with heads_in(b.parent / "keys.db") as other:  # a store with two folders' heads: no guessing
        other.save(tmp_path / "elsewhere", read_head(b.parent / "keys.db", was))
    code, out, err = verify_cli(capsys, b)
    assert (code, out) == (0, "ok: 3 records in 1 files\n")
    assert err.startswith(f"note: no chain head recorded for {b} in ")


# -- the real server and the real `zerohop audit verify` ---------------------------------------

FSIZE = resource.RLIMIT_FSIZE
FILLER = 2 * 2**20  # the audit file's size before the server starts: more than keys.db grows


def zerohop_verify(directory: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "zerohop", "audit", "verify", str(directory), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)


def ask(server: LiveServer, surface: str = "anthropic") -> httpx.Response:
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    path = "/v1/messages" if surface == "anthropic" else "/v1/chat/completions"
    return httpx.post(server.url + path, json=body, timeout=60)


def data_dir(log: Path) -> Path:
    """Where LiveServer's server keeps its key store and (by default) its audit log."""
    return log.parent / "data" / "zerohop"


def wait_for(what: Callable[[], object], timeout: float = 60.0) -> object:
    """Poll until `what()` is truthy; the timeout is a safety net, not the assertion."""
    deadline = time.monotonic() + timeout
    while not (value := what()):
        assert time.monotonic() < deadline, "the awaited state never came"
        time.sleep(0.05)
    return value


def metric(server: LiveServer, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    [value] = [ln.split()[-1] for ln in text.splitlines() if ln.startswith(name + " ")]
    return float(value)


def test_live_truncated_tail_is_reported_by_zerohop_audit_verify(
    llama_dir: Path, tmp_path: Path
) -> None:
    log = tmp_path / "server.log"
    server = LiveServer(llama_dir).start(log)
    try:
        assert all(ask(server).status_code == 200 for _ in range(3))
    finally:
        assert server.stop() == 0  # a clean shutdown records the final head
    audit_dir, db = data_dir(log) / "audit", data_dir(log) / "keys.db"
    ok = zerohop_verify(audit_dir)  # finds keys.db beside the audit folder, as serve lays it out
    assert (ok.returncode, ok.stdout) == (0, "ok: 3 records in 1 files\n"), ok.stderr
    head = read_head(db, audit_dir)
    assert head is not None and head.seq == 2

    [removed] = drop_last_lines(audit_dir / CURRENT, 1)
    cut = zerohop_verify(audit_dir, "--keys-db", str(db))
    assert cut.returncode == 1
    assert cut.stdout == (
        f"truncated: the chain head recorded at {head.describe()} is missing;"
        " the log ends at record 1\n"
    )
    assert f"hash {hashlib.sha256(removed).hexdigest()})" in cut.stdout

    # Restarted on the cut log: the chain goes on after the recorded head, the gap stays.
    server = LiveServer(llama_dir).start(log)
    try:
        assert ask(server).status_code == 200
    finally:
        assert server.stop() == 0
    gap = zerohop_verify(audit_dir)
    assert gap.returncode == 1
    assert (
        gap.stdout
        == f"broken: {CURRENT} line 3: seq 3: records 2 missing here (deleted or moved)\n"
    )

    (audit_dir / CURRENT).unlink()  # every file gone
    gone = zerohop_verify(audit_dir)
    assert gone.returncode == 1 and gone.stdout.startswith("truncated: the chain head recorded")
    assert gone.stdout.endswith("(record 3, hash " + read_head(db, audit_dir).hash + ")"
                                " is missing; the log holds no records\n")  # fmt: skip


def test_live_records_after_the_last_recorded_head_lost_in_a_crash_are_not_truncation(
    llama_dir: Path, tmp_path: Path
) -> None:
    log = tmp_path / "server.log"
    server = LiveServer(llama_dir).start(log)
    audit_dir, db = data_dir(log) / "audit", data_dir(log) / "keys.db"
    try:
        assert ask(server).status_code == 200
        wait_for(lambda: read_head(db, audit_dir))  # recorded while serving, within ~1 s
        for written in range(2, 22):  # until a record is on disk no recorded head covers
            assert ask(server).status_code == 200
            wait_for(lambda n=written: len(lines(audit_dir)) == n)
            if written > read_head(db, audit_dir).seq + 1:
                break
    finally:
        server.process.kill()  # kill -9: no final head
        server.process.wait(30)
    head = read_head(db, audit_dir)
    lost = drop_last_lines(audit_dir / CURRENT, len(lines(audit_dir)) - head.seq - 1)
    print(f"{len(lost)} records after the recorded head, dropped as a crash would lose them")
    ok = zerohop_verify(audit_dir)  # the log still holds the recorded head: not truncated
    assert (ok.returncode, ok.stdout) == (0, f"ok: {head.seq + 1} records in 1 files\n")
    drop_last_lines(audit_dir / CURRENT, 1)  # now the recorded head itself is gone
    cut = zerohop_verify(audit_dir)
    assert cut.returncode == 1 and cut.stdout.startswith("truncated: ")


# -- audit directory failures: real EFBIG from RLIMIT_FSIZE on the server process --------------


def prefilled(log: Path) -> Path:
    """The server's audit file, made FILLER bytes long before it starts (one valid record)."""
    audit_dir = data_dir(log) / "audit"
    with AuditLog(audit_dir) as filler:
        filler.record({"request_id": "filler", "pad": "x" * FILLER})
    return audit_dir / CURRENT


@contextlib.contextmanager
def audit_file_cannot_grow(pid: int, path: Path) -> Iterator[None]:
    """Process `pid` can grow no file past the size `path` has now (EFBIG: Python ignores
    SIGXFSZ); lifting the limit is the disk taking writes again."""
    soft, hard = resource.prlimit(pid, FSIZE)
    resource.prlimit(pid, FSIZE, (path.stat().st_size, hard))
    try:
        yield
    finally:
        resource.prlimit(pid, FSIZE, (soft, hard))


def test_live_audit_failure_open_serves_and_counts_the_lost_records(
    llama_dir: Path, tmp_path: Path
) -> None:
    log = tmp_path / "server.log"
    current = prefilled(log)
    server = LiveServer(llama_dir, ["--audit-max-pending", "2"]).start(log)
    try:
        assert ask(server).status_code == 200
        wait_for(lambda: metric(server, "zerohop_audit_records_written_total") == 1)
        with audit_file_cannot_grow(server.process.pid, current):
            assert [ask(server).status_code for _ in range(4)] == [200] * 4  # served on
            wait_for(lambda: metric(server, "zerohop_audit_records_lost_total") == 2)
            assert metric(server, "zerohop_audit_records_pending") == 2
            assert metric(server, "zerohop_audit_failing") == 1
            assert httpx.get(server.url + "/health", timeout=30).status_code == 200
            # Retried at every flush: wait for a few failed writes (counted, not timed).
            errors = wait_for(lambda: metric(server, "zerohop_audit_write_errors_total") >= 3)
            errors = metric(server, "zerohop_audit_write_errors_total")
        wait_for(lambda: metric(server, "zerohop_audit_failing") == 0)
        assert metric(server, "zerohop_audit_records_pending") == 0
    finally:
        assert server.stop() == 0
    said = [ln for ln in server.log().splitlines() if "audit: cannot write the log" in ln]
    assert 1 <= len(said) < errors  # logged once per interval, not once per failed write
    assert "Traceback" not in server.log()
    ok = zerohop_verify(current.parent)
    assert ok.returncode == 0, ok.stdout
    recs = records(current.parent)
    assert [r["status"] for r in recs if "status" in r] == [200] * 3  # 1 + the 2 kept
    [marker] = [r for r in recs if "audit_lost" in r]
    assert marker["audit_lost"] == 2 and "could not be written" in marker["audit_error"]


def test_live_audit_failure_closed_refuses_with_503_until_the_log_can_be_written(
    llama_dir: Path, tmp_path: Path
) -> None:
    log = tmp_path / "server.log"
    current = prefilled(log)
    server = LiveServer(llama_dir, ["--audit-failure", "closed"]).start(log)
    try:
        assert ask(server).status_code == 200
        wait_for(lambda: metric(server, "zerohop_audit_records_written_total") == 1)
        with audit_file_cannot_grow(server.process.pid, current):
            first = ask(server)  # admitted before any write failed; its record waits
            assert first.status_code == 200
            wait_for(lambda: metric(server, "zerohop_audit_failing") == 1)
            refused, refused_openai = ask(server), ask(server, "openai")
            assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        wait_for(lambda: ask(server).status_code == 200)  # serves again once writes succeed
    finally:
        assert server.stop() == 0
    assert refused.status_code == 503 and refused.headers["x-should-retry"] == "true"
    error = refused.json()
    assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"
    assert "audit log cannot be written" in error["error"]["message"]
    assert refused_openai.status_code == 503
    assert refused_openai.json()["error"]["code"] == "audit_unavailable"
    assert zerohop_verify(current.parent).returncode == 0
    recs = records(current.parent)
    assert statuses(recs)[:3] == [200, 200, 503]  # refusals are audited too
    assert not any("audit_lost" in r for r in recs)  # nothing lost: all kept and written


def statuses(recs: list[dict]) -> list[int]:
    return [r["status"] for r in recs if "status" in r]


def test_failure_state_keeps_the_oldest_counts_the_rest_and_marks_them_once() -> None:
    failures = AuditFailures("open", max_pending=2)
    error = OSError(27, "File too large")
    kept = failures.failed(error, [entry(i) for i in range(5)])
    assert [e["request_id"] for e in kept] == ["req-0", "req-1"]
    assert (failures.lost, failures.pending, failures.failing) == (3, 2, True)
    assert not failures.refusing  # open: serving goes on
    marker = failures.take_marker()
    assert marker is not None and marker["audit_lost"] == 3
    again = failures.failed(error, [*kept, marker, entry(5)])  # the marker was not written
    assert [e["request_id"] for e in again] == ["req-0", "req-1"]
    assert failures.lost == 4 and failures.write_errors == 2  # req-5, not the marker
    assert failures.take_marker()["audit_lost"] == 4  # one marker tells all four
    failures.succeeded()
    assert failures.take_marker() is None and not failures.failing
    closed = AuditFailures("closed")
    closed.failed(error, [entry(0)])
    assert closed.refusing
    closed.succeeded()
    assert not closed.refusing
