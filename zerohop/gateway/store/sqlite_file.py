"""SQLite files the process's one store (`store.Store`) opens beside its database, such as the
batches' `batches.db`. Each is opened once per process, on its first use, and closed with the
store; its one connection is shared by its users under the file's lock.

The store applies the schema its user passes (SQL text), so the gateway never imports the
batches package that writes the tables.
"""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass, field
from pathlib import Path

from zerohop.gateway.store.sqlite import open_wal


@dataclass(frozen=True, slots=True)
class SqliteFile:
    """One SQLite file's one connection (WAL, explicit transactions) and the lock its users
    take around each statement or transaction."""

    path: Path
    conn: sqlite3.Connection
    lock: threading.RLock = field(default_factory=threading.RLock)


class SqliteFiles:
    """The files a store opened, by path: each opened once, all closed together."""

    def __init__(self) -> None:
        self._files: dict[Path, SqliteFile] = {}
        self._opening = threading.Lock()

    def open(self, path: Path, schema: str, synchronous: str) -> SqliteFile:
        """The file at `path`, opened with `schema` (and `synchronous`) unless it is already."""
        key = path.resolve()
        with self._opening:
            opened = self._files.get(key)
            if opened is None:
                opened = self._files[key] = SqliteFile(path, open_wal(path, schema, synchronous))
            return opened

    def close(self) -> None:
        """Close every file; a later `open` opens it again."""
        with self._opening:
            files, self._files = list(self._files.values()), {}
        for file in files:
            with file.lock:
                file.conn.close()
