"""The audit log: one hash-chained JSON Lines record per request, written off the request path.

Format. Each line is one JSON object and b"\\n". The writer adds two fields to every record:
`"seq"`, counting records from 0 over the log's whole life, and `"prev"`, the hex SHA-256 of
the previous record's line: exactly the bytes stored in the file, without their b"\\n" (the
first record ever has 64 zeros). `time`, if the caller gives a number (or none: the time of
`record()`), is written as RFC 3339 UTC with microseconds.

Files. `audit.jsonl` is the current file. When a record would take it past `max_bytes` it is
renamed `audit-<UTC %Y%m%dT%H%M%S.%fZ>-<seq>.jsonl` (never earlier than the previous rotated
name, so names sort oldest first) and a new `audit.jsonl` begins. The chain runs across
rotations and restarts: in order, the rotated files by name, then `audit.jsonl`.

Torn lines. Only a file's last bytes may lack a b"\\n": a write cut short by a crash. That
fragment is not a record, and the chain continues from the last complete line before it. On
start, an `audit.jsonl` that ends torn is rotated as it is (nothing in the log is rewritten)
and the new file chains to its last complete line; `verify` skips a file's unterminated tail
the same way and lists it in `VerifyResult.torn`. Deleting or editing a record, or removing
the newline of a record that is not the log's last, breaks the chain at the next record.

The API process's SIGTERM shutdown calls `close()`, as does an atexit hook on any normal
interpreter exit: everything queued is written and fsynced. See LOSS_BOUND for `kill -9`.

Chain head. With a `heads` repository (`zerohop.gateway.store.audit_heads`: a table in the
replica's SQLite file) the writer records the chain head there at most every `head_interval`
seconds while writing, and at close(), so that `zerohop audit verify` reports a log whose
newest records were deleted. A log found at start ending before its recorded head continues
the chain from the recorded head: the records deleted stay visible as a gap in seq.

Failures. A write that fails (disk error, full disk) is retried at every flush; what is kept
meanwhile, what is lost, and whether requests are refused (`--audit-failure open|closed`)
is `zerohop.gateway.audit.failure`'s.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import logging
import os
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import orjson

from zerohop.gateway.audit.failure import DEFAULT_MAX_PENDING, AuditFailures, FailureMode
from zerohop.gateway.audit.heads import check_head
from zerohop.gateway.audit.record import AuditRecord
from zerohop.gateway.store.audit_heads import AuditHeadRepository, ChainHead

log = logging.getLogger(__name__)

LOSS_BOUND = (
    "A kill -9 (or power loss) loses at most the records queued in the last flush_interval "
    "seconds, plus those queued while the write and fsync in progress ran; what is on disk "
    "is always a whole prefix of the chain, possibly followed by one torn line that is ignored."
)
CURRENT = "audit.jsonl"
LOCK = ".audit.lock"
ZERO_HASH = "0" * 64
CONTENT_FIELDS = ("prompt", "output")
_ROTATED = re.compile(r"^audit-(\d{8}T\d{6}\.\d{6}Z)-(\d+)\.jsonl$")
_DUMPS_OPTIONS = orjson.OPT_NON_STR_KEYS


@dataclass(slots=True)
class VerifyResult:
    ok: bool
    records: int
    files: int
    first_broken: str | None = None  # "<file> line <n>: <reason>"
    torn: list[str] = field(default_factory=list)  # "<file> line <n>": ignored unterminated tails
    truncated: str | None = None  # why the log does not hold the recorded chain head


class AuditLog:
    """Appends one record per request to `directory`; see the module docstring and LOSS_BOUND."""

    def __init__(
        self,
        directory: Path,
        *,
        max_bytes: int = 64 * 2**20,
        flush_interval: float = 0.2,
        include_content: bool = False,
        heads: AuditHeadRepository | None = None,
        head_interval: float = 1.0,
        failure: FailureMode = "open",
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        if max_bytes <= 0 or flush_interval <= 0 or head_interval <= 0:
            raise ValueError("max_bytes, flush_interval and head_interval must be positive")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.flush_interval = flush_interval
        self._include_content = include_content
        self.failures = AuditFailures(failure, max_pending)
        # The chain head as last recorded in `heads` (writer state too).
        self._heads = heads
        self.head_interval = head_interval
        self._head_file = CURRENT  # the file holding the newest record
        self._saved_seq = 0  # self._seq when the head was last recorded
        self._saved_at = float("-inf")  # time.monotonic() then
        # The only state record() touches: deque.append is atomic and takes no lock.
        self._queue: deque[AuditRecord] = deque()
        self._closed = False
        self.written = 0
        self.dropped = 0  # records offered after close()
        # Writer state: the writer thread's alone (and close()'s, after joining it).
        self._retry: list[AuditRecord] = []
        self._fd: int | None = None
        self._lock_fd: int | None = None
        self._size = 0
        self._seq = 0
        self._prev = ZERO_HASH
        self._last_rotated = ("", 0)  # (timestamp, seq) of the newest rotated file name
        self._wake = threading.Event()
        self._close_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def include_content(self) -> bool:
        return self._include_content

    def recorded_head(self) -> ChainHead | None:
        """The chain head last recorded for this log (from any thread); None without a
        heads repository. Read it before the files: the writer records a head only once
        the records up to it are on disk."""
        return None if self._heads is None else self._heads.load(self.directory)

    @property
    def refusing(self) -> bool:
        """`--audit-failure closed` and the log cannot be written now: refuse new requests."""
        return self.failures.refusing

    def __enter__(self) -> AuditLog:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def record(self, entry: AuditRecord) -> None:
        """Queue one record (the log owns `entry` from now on); never blocks, never does I/O."""
        if self._closed:
            self.dropped += 1
            return
        if not self._include_content:
            for key in CONTENT_FIELDS:
                entry.pop(key, None)
        if "time" not in entry:
            entry["time"] = time.time()
        self._queue.append(entry)

    def start(self) -> None:
        if self._closed:
            raise RuntimeError("audit log is closed")
        if self._thread is not None:
            return
        self._open()
        self._thread = threading.Thread(target=self._run, name="zerohop-audit", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def close(self) -> None:
        """Write and fsync everything queued, stop the writer; a second call does nothing."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            atexit.unregister(self.close)
            if self._thread is not None:
                self._wake.set()
                self._thread.join()
            elif self._queue:
                self._open()
            if self._fd is None and self._lock_fd is None:
                return
            self._write_batch()  # what record() queued after the writer's last drain
            self.failures.closing_with(len(self._retry))
            self._save_head(force=True)  # the store that keeps it closes after the log
            for fd in (self._fd, self._lock_fd):
                if fd is not None:
                    os.close(fd)
            self._fd = self._lock_fd = None

    # The writer.

    def _run(self) -> None:
        next_at = time.monotonic() + self.flush_interval
        while True:
            stopping = self._wake.wait(max(0.0, next_at - time.monotonic()))
            next_at = time.monotonic() + self.flush_interval
            self._write_batch()
            if stopping:
                return
            self._save_head(force=False)

    def _open(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock(self.directory / LOCK)
        rotated = _rotated(self.directory)
        if rotated:
            self._last_rotated = (rotated[-1][0], rotated[-1][1])
        current = self.directory / CURRENT
        if _ends_torn(current):
            self._rename_current()
        found = _chain_head(self.directory)
        if found is not None:
            self._head_file, head = found
            self._prev = hashlib.sha256(head).hexdigest()
            self._seq = _seq_of(head) + 1
        self._continue_from_recorded_head()
        self._open_current()

    def _continue_from_recorded_head(self) -> None:
        """A log that ends before its recorded head lost its tail: chain on from the head."""
        recorded = None if self._heads is None else self._heads.load(self.directory)
        if recorded is None:
            return
        self._saved_seq = recorded.seq + 1
        if recorded.seq < self._seq:
            return  # the log holds it (verify checks its hash) and maybe records after it
        reason = check_head(recorded, self._seq - 1 if self._seq else None, None)
        log.error(
            "audit: %s: %s; the chain continues from the recorded head, so the records"
            " deleted show as a gap", self.directory, reason,
        )  # fmt: skip
        self._seq, self._prev, self._head_file = recorded.seq + 1, recorded.hash, recorded.file

    def _save_head(self, *, force: bool) -> None:
        """Record the chain head: at most every head_interval, or now if `force`."""
        if self._heads is None or self._seq == self._saved_seq:
            return
        now = time.monotonic()
        if not force and now - self._saved_at < self.head_interval:
            return
        head = ChainHead(self._seq - 1, self._prev, self._head_file, time.time())
        try:
            self._heads.save(self.directory, head)
        except Exception as exc:  # the log itself is written: go on, say so
            log.error("audit: cannot record the chain head in %s: %s", self._heads.where, exc)
            self._saved_at = now  # try again an interval later, not at every flush
            return
        self._saved_seq, self._saved_at = self._seq, now

    def _open_current(self) -> None:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
        self._fd = os.open(self.directory / CURRENT, flags, 0o600)
        self._size = os.fstat(self._fd).st_size
        _fsync_dir(self.directory)

    def _rename_current(self) -> None:
        stamp = max(datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ"), self._last_rotated[0])
        seq = self._last_rotated[1] + 1
        os.rename(self.directory / CURRENT, self.directory / f"audit-{stamp}-{seq:06d}.jsonl")
        self._last_rotated = (stamp, seq)

    def _rotate(self) -> None:
        assert self._fd is not None
        os.close(self._fd)
        self._fd = None
        self._rename_current()
        self._open_current()

    def _write_batch(self) -> None:
        entries, self._retry = self._retry, []
        if (marker := self.failures.take_marker()) is not None:
            entries.append(marker)  # after what was kept, before what came since
        while self._queue:
            entries.append(self._queue.popleft())
        if not entries:
            return
        done = 0
        try:
            if self._fd is None:
                self._open_current()
            while done < len(entries):
                done += self._write_file_chunk(entries[done:])
                if done < len(entries):
                    self._rotate()
        except Exception as exc:
            self._retry = self.failures.failed(exc, entries[done:])
        else:
            self.failures.succeeded()

    def _write_file_chunk(self, entries: list[AuditRecord]) -> int:
        """Append as many records as fit in the current file; return how many were written."""
        seq, prev, size, lines = self._seq, self._prev, self._size, []
        for entry in entries:
            line = _serialize(entry, seq, prev)
            if size > 0 and size + len(line) + 1 > self.max_bytes:
                break  # a record larger than max_bytes gets a file of its own
            lines.append(line)
            size += len(line) + 1
            seq += 1
            prev = hashlib.sha256(line).hexdigest()
        if lines:
            self._append(b"\n".join(lines) + b"\n")
            self._seq, self._prev, self._size = seq, prev, size
            self._head_file = CURRENT
            self.written += len(lines)
        return len(lines)

    def _append(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
            self._sync(self._fd)
        except OSError:
            # Undo a partial write, so that the retry does not follow a torn line.
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)
            raise

    def _sync(self, fd: int) -> None:
        os.fsync(fd)


def _serialize(entry: AuditRecord, seq: int, prev: str) -> bytes:
    stamp = entry.get("time")
    if isinstance(stamp, int | float):
        iso = datetime.fromtimestamp(stamp, UTC).isoformat(timespec="microseconds")
        entry["time"] = iso.replace("+00:00", "Z")
    entry["seq"] = seq
    entry["prev"] = prev
    try:
        return orjson.dumps(entry, default=str, option=_DUMPS_OPTIONS)
    except (TypeError, orjson.JSONEncodeError) as exc:
        keep = {"time": entry.get("time"), "request_id": str(entry.get("request_id"))}
        fallback = {**keep, "audit_error": f"unserializable record: {exc}"}
        return orjson.dumps({**fallback, "seq": seq, "prev": prev})


def _lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(f"{path.parent} is in use by another audit log") from None
    return fd


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rotated(directory: Path) -> list[tuple[str, int, Path]]:
    found = []
    for path in directory.iterdir():
        if m := _ROTATED.match(path.name):
            found.append((m[1], int(m[2]), path))
    return sorted(found)


def log_files(directory: Path) -> list[Path]:
    """The log's files, oldest first."""
    files = [path for _, _, path in _rotated(directory)]
    if (directory / CURRENT).exists():
        files.append(directory / CURRENT)
    return files


def _ends_torn(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            if f.seek(0, os.SEEK_END) == 0:
                return False
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except FileNotFoundError:
        return False


def _last_complete_line(path: Path, block: int = 1 << 16) -> bytes | None:
    """The file's last b"\\n"-terminated line, without it; None if it has none."""
    with path.open("rb") as f:
        pos = f.seek(0, os.SEEK_END)
        buf = b""
        while pos > 0:
            step = min(block, pos)
            pos -= step
            f.seek(pos)
            buf = f.read(step) + buf
            end = buf.rfind(b"\n")
            if end == -1:
                continue
            start = buf.rfind(b"\n", 0, end)
            if start != -1:
                return buf[start + 1 : end]
            if pos == 0:
                return buf[:end]
        return None


def _chain_head(directory: Path) -> tuple[str, bytes] | None:
    """(file name, line) of the log's newest complete record."""
    for path in reversed(log_files(directory)):
        line = _last_complete_line(path)
        if line is not None:
            return path.name, line
    return None


def _seq_of(line: bytes) -> int:
    try:
        seq = orjson.loads(line).get("seq")
    except (orjson.JSONDecodeError, AttributeError):
        return -1  # an unreadable head: verify names it; keep counting from 0
    return seq if isinstance(seq, int) else -1


def verify(
    directory: Path, *, trust_first: bool = False, head: ChainHead | None = None
) -> VerifyResult:
    """Check the whole chain; `trust_first` accepts a log whose oldest files were removed;
    with `head` (the recorded chain head) the log must hold it (else `truncated` says why)."""
    files = log_files(Path(directory))
    prev: str | None = None if trust_first else ZERO_HASH
    seq: int | None = None if trust_first else 0
    prev_at = ""
    records, torn = 0, list[str]()
    hash_at_head = None

    def broken(where: str, reason: str) -> VerifyResult:
        return VerifyResult(False, records, len(files), f"{where}: {reason}", torn)

    for path in files:
        with path.open("rb") as f:
            for n, line in enumerate(f, 1):
                where = f"{path.name} line {n}"
                if not line.endswith(b"\n"):
                    torn.append(where)
                    break
                body = line[:-1]
                try:
                    rec = orjson.loads(body)
                except orjson.JSONDecodeError:
                    return broken(where, "not a JSON record")
                if not isinstance(rec, dict):
                    return broken(where, "not a JSON object")
                got_seq, got_prev = rec.get("seq"), rec.get("prev")
                if not isinstance(got_seq, int) or not isinstance(got_prev, str):
                    return broken(where, 'no "seq" or "prev" field')
                if seq is not None and got_seq > seq:
                    missing = f"{seq}" if got_seq == seq + 1 else f"{seq}..{got_seq - 1}"
                    reason = f"seq {got_seq}: records {missing} missing here (deleted or moved)"
                    return broken(where, reason)
                if seq is not None and got_seq < seq:
                    return broken(where, f"seq {got_seq} after seq {seq - 1}: records reordered")
                if prev is not None and got_prev != prev:
                    if not prev_at:
                        return broken(where, "the first record's prev is not 64 zeros")
                    return broken(prev_at, f"edited: its SHA-256 is not the prev of {where}")
                prev, seq, prev_at = hashlib.sha256(body).hexdigest(), got_seq + 1, where
                records += 1
                if head is not None and got_seq == head.seq:
                    hash_at_head = prev
    result = VerifyResult(True, records, len(files), None, torn)
    if head is not None:
        last_seq = None if seq is None or records == 0 else seq - 1
        result.truncated = check_head(head, last_seq, hash_at_head)
        result.ok = result.truncated is None
    return result
