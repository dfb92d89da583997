"""A fleet replica's local copy of the keys it last read from PostgreSQL (`serve --store`),
so that it can start while PostgreSQL is down.

Each time a replica reads the keys from the store (at start-up, on every change, and at
the key feed's full reload every 10 minutes) it writes the rows it read, tenants and keys
with their secret hashes (never a secret), to one JSON file (`--store-snapshot`, by default
beside `--keys-db`): a temporary file in the same folder, mode 0600, fsynced, renamed over
the last one, the folder fsynced. The file records the store it came from (its URL without
the password) and when its rows were read.

A replica that cannot reach the store at start-up serves that file's keys when it is of
the same store and was read at most `--store-snapshot-max-age` ago (`/metrics` and
`/ready` say so), and its key feed catches up with a full reload as soon as PostgreSQL
answers: a key revoked meanwhile is refused from then on. Without a usable file the start
fails in one line, as it did before. A store that answers with the wrong schema is never
bypassed this way.

Budget leases are not kept. A lease belongs to the process that took it (its replica id
ends with it; a drained replica returns its leases, a killed one's are charged at their
TTL, and what it spent last may not be reported), so a restarted replica cannot know how
much of one is left. A replica started from the file holds none, and budgeted keys get the
outage's retryable refusal until the store answers.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zerohop.gateway.store.rows import KeyRows
from zerohop.gateway.store.spec import SchemaMismatch, StoreUnavailable, one_line

log = logging.getLogger(__name__)

FORMAT = 1  # the file's layout; another one is not read
FILE_NAME = "store-snapshot.json"  # beside --keys-db unless --store-snapshot names a file
CLOCK_SLACK = 300.0  # seconds a file may seem to come from the future (clocks differ)


class SnapshotUnusable(Exception):
    """Why the local snapshot cannot be served (one line)."""


class LocalCopy:
    """One replica's snapshot file, and what `/metrics` and `/ready` say of it. `read_at`
    (wall clock) is when the rows in the file were read from the store; `serving` is true
    while the keys served are the file's, from a start-up without the store until the key
    feed first reads the store."""

    def __init__(self, path: Path, store: str, max_age: float) -> None:
        self.path = path
        self.store = store  # the store's URL, its password masked
        self.max_age = max_age
        self.read_at: float | None = None
        self.serving = False
        self.write_errors = 0

    def age(self, now: float | None = None) -> float | None:
        """Seconds since the file's rows were read from the store (None: no file known)."""
        if self.read_at is None:
            return None
        return max(0.0, (time.time() if now is None else now) - self.read_at)

    def save(self, rows: KeyRows, read_at: float) -> None:
        """Keep `rows`, read from the store at `read_at`, as the snapshot (blocking: off the
        event loop). A failure is logged and counted, never raised: the replica serves on."""
        self.serving = False
        document = {
            "format": FORMAT,
            "store": self.store,
            "read_at": read_at,
            "version": rows.version,
            "tenants": rows.tenants,
            "keys": rows.keys,
        }
        try:
            _write_atomically(self.path, json.dumps(document, default=str).encode())
        except (OSError, ValueError) as exc:
            self.write_errors += 1
            if self.write_errors == 1 or self.read_at is not None:  # once per failing streak
                log.warning("keys: the local snapshot %s cannot be written: %s", self.path, exc)
            self.read_at = None
            return
        self.read_at = read_at

    def load(self, now: float | None = None) -> KeyRows:
        """The file's rows, to serve while the store cannot be reached; SnapshotUnusable
        when there is no file, it is of another store, too old, or not readable."""
        now = time.time() if now is None else now
        document = self._document()
        if document.get("format") != FORMAT:
            raise SnapshotUnusable(f"{self.path} has format {document.get('format')!r}")
        if document.get("store") != self.store:
            raise SnapshotUnusable(f"{self.path} is of another store ({document.get('store')})")
        read_at = document.get("read_at")
        if not isinstance(read_at, int | float) or read_at > now + CLOCK_SLACK:
            raise SnapshotUnusable(f"{self.path} has no valid read time: {read_at!r}")
        if now - read_at > self.max_age:
            raise SnapshotUnusable(
                f"{self.path} is {_duration(now - read_at)} old, past --store-snapshot-max-age"
                f" ({_duration(self.max_age)})"
            )
        try:
            rows = KeyRows(int(document["version"]), document["tenants"], document["keys"])
            rows.index()  # every row must read back, here rather than on a request
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SnapshotUnusable(f"{self.path} is not a valid snapshot: {one_line(exc)}") from exc
        self.read_at, self.serving = float(read_at), True
        return rows

    def _document(self) -> dict[str, Any]:
        try:
            document = json.loads(self.path.read_bytes())
        except FileNotFoundError:
            raise SnapshotUnusable(f"{self.path} does not exist") from None
        except OSError as exc:
            raise SnapshotUnusable(f"{self.path}: {exc.strerror or one_line(exc)}") from exc
        except ValueError as exc:
            raise SnapshotUnusable(f"{self.path} is not JSON: {one_line(exc)}") from exc
        if not isinstance(document, dict):
            raise SnapshotUnusable(f"{self.path} is not a snapshot")
        return document


def read_or_load(
    read: Callable[[], KeyRows], local: LocalCopy | None, *, announce: bool = True
) -> KeyRows:
    """The store's keys (`read`), saved to `local`; while the store cannot be reached, the
    keys `local` holds (logged, if `announce`). StoreUnavailable (one line: the store's
    error, then why the snapshot cannot be used) when neither can be had."""
    try:
        read_at = time.time()
        rows = read()
    except SchemaMismatch:
        raise  # the store answers: it must be migrated, not bypassed
    except StoreUnavailable as exc:
        if local is None:
            raise
        try:
            rows = local.load()
        except SnapshotUnusable as why:
            message = f"{exc}; and no local snapshot of its keys to start from: {why}"
            raise StoreUnavailable(message) from exc
        if not announce:
            return rows
        log.warning(
            "keys: %s; serving the %d keys of the local snapshot %s, read from the store %s"
            " ago, until it answers",
            exc,
            len(rows.keys),
            local.path,
            _duration(local.age() or 0.0),
        )
        return rows
    if local is not None:
        local.save(rows, read_at)
    return rows


def _write_atomically(path: Path, data: bytes) -> None:
    """`data` as `path`, whole or not at all, durable once this returns; mode 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)  # a leftover temporary file would keep its mode
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
