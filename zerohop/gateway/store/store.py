"""The process's one store: a SQLite file or a fleet's PostgreSQL, opened once (on first
use) by whoever composes the server, and the typed repositories its consumers receive.

```
store = Store.of(spec)            # nothing is opened yet
Threads(store.threads)            # each consumer gets the repository it needs
...
store.close()                     # once, when the server stops
```

Opening is lazy so that a server starts while its store is down: the first call that needs
the database opens it, and a call after a failed open tries again (the calls that waited for
that open get its error, rather than each trying in turn). The database serializes its own
use (see `repositories`), so consumers share it without a lock of their own. Two keep a
connection of their own, each opened by its repository and closed by `close`, for the
reason its module gives: the SQLite budget ledger's group-commit writer (`ledger_tables`)
and a fleet's budget leases and rate shares (`lease_repository`). A fleet replica's key
feed LISTENs on a session of its own too (`pg_key_feed`: a pooled connection would lose it).

The audit logs' chain heads (`audit_heads`) are in the store's SQLite file, on its one
connection; on a PostgreSQL fleet they stay in the replica's own SQLite file (`local`),
beside the log they guard.

Batches (zerohop.batches, which the gateway never imports) get their database from the store
too, and open no connection of their own:

- On PostgreSQL, the batch tables are in the store's database, reached through its one pool
  (`postgres_pool`); the store closes it.
- On SQLite, batches keep their own file (`batch_file`, `--batches-db`, `batches.db` beside
  the keys by default, file contents in `batches-files/` beside it): a batch writes whole
  input files as lines and every line's result, traffic that must not hold the keys' one
  connection lock, and operators' existing `batches.db` files stay where they are. The store
  opens that file once per process and closes it with its own database.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from zerohop.gateway.store import audit_heads
from zerohop.gateway.store.audit_heads import AuditHeadRepository
from zerohop.gateway.store.lease_repository import LeaseRepository
from zerohop.gateway.store.open_store import Database, open_database
from zerohop.gateway.store.repositories import (
    IN_MEMORY,
    KeyRepository,
    LedgerRepository,
    Opener,
    ResponseRepository,
    SessionRepository,
    SigningKeyRepository,
    ThreadRepository,
    UsageRepository,
)
from zerohop.gateway.store.spec import StoreSpec
from zerohop.gateway.store.sqlite import KeyStore, default_db_path
from zerohop.gateway.store.sqlite_file import SqliteFile, SqliteFiles

if TYPE_CHECKING:  # psycopg is imported only where a PostgreSQL store is opened
    from psycopg_pool import ConnectionPool


class Store:
    """One database, opened on first use, and its repositories. `spec` (None: a store that
    `open_` alone knows, as tests make) names the database for the repositories that keep a
    connection of their own; `local` is a fleet replica's own SQLite file (its --keys-db)."""

    def __init__(
        self, open_: Opener, spec: StoreSpec | None = None, local: Path | None = None
    ) -> None:
        self._open = open_
        self._description = "the store" if spec is None else spec.describe()
        self._database: Database | None = None
        self._opening = threading.Lock()
        self._failed: tuple[float, Exception] | None = None  # the last failed open: when, why
        self._files = SqliteFiles()
        self.keys = KeyRepository(self.database)
        self.ledger = LedgerRepository(self.database, spec)  # its writer: its own connection
        self.usage = UsageRepository(self.database)
        self.threads = ThreadRepository(self.database)
        self.responses = ResponseRepository(self.database)
        self.sessions = SessionRepository(self.database)
        self.signing_keys = SigningKeyRepository(self.database)
        # A fleet's budget leases and rate shares, on a connection of their own (see
        # lease_repository); on a SQLite store a call raises NotAFleetStore.
        fleet = spec is not None and spec.kind == "postgresql"
        url = spec.url if spec is not None and fleet else None
        self.leases = LeaseRepository(url, self._description)
        # The audit logs' chain heads: in the store's own SQLite file, or a fleet replica's
        # local one (audit_heads says why a head stays on the replica).
        self.heads_file = (local or default_db_path()) if fleet else None
        where = self._description if self.heads_file is None else str(self.heads_file)
        self.audit_heads = AuditHeadRepository(self._heads_connection, where)

    @classmethod
    def of(cls, spec: StoreSpec, local: Path | None = None) -> Store:
        """The store `spec` names (StoreUnavailable from a call while it cannot be opened).
        `local`: a fleet replica's own SQLite file, for what stays on the replica (its
        audit logs' chain heads; by default the default --keys-db)."""
        return cls(lambda: open_database(spec), spec, local)

    @classmethod
    def in_memory(cls) -> Store:
        """A store of this process's own, gone when it ends (a server without a gateway)."""
        return cls.of(StoreSpec.sqlite(Path(IN_MEMORY)))

    def database(self) -> Database:
        """The database, opened now unless it is already (the open's error is raised)."""
        database = self._database
        if database is not None:
            return database
        asked = time.monotonic()
        with self._opening:
            if self._database is not None:
                return self._database
            if self._failed is not None and self._failed[0] >= asked:
                raise self._failed[1]  # an open tried while this call waited failed
            try:
                self._database = self._open()
            except Exception as exc:
                self._failed = (time.monotonic(), exc)
                raise
            self._failed = None
            return self._database

    def postgres_pool(self) -> ConnectionPool:
        """The PostgreSQL store's one pool, for the batch tables in its database (opened now
        unless it is already; TypeError on a SQLite store)."""
        from zerohop.gateway.store.postgres import PostgresStore

        database = self.database()
        if not isinstance(database, PostgresStore):
            raise TypeError(f"{self._description} is not a PostgreSQL store: it has no pool")
        return database.pool

    @contextmanager
    def _heads_connection(self) -> Iterator[sqlite3.Connection]:
        if self.heads_file is not None:
            file = self._files.open(self.heads_file, audit_heads.SQLITE_SCHEMA, "FULL")
            with file.lock:
                yield file.conn
            return
        database = self.database()
        if not isinstance(database, KeyStore):
            raise TypeError(f"{self._description} keeps no audit heads")
        with database.locked() as conn:
            yield conn

    def batch_file(self, path: Path, schema: str, synchronous: str = "NORMAL") -> SqliteFile:
        """The batches' SQLite file at `path`, opened with their `schema` on its first use
        in this process, and closed by `close`."""
        return self._files.open(path, schema, synchronous)

    def describe(self) -> str:
        """The store, for people (a password masked)."""
        return self._description

    def close(self) -> None:
        """Close the database and the leases' connection if they were opened; a later call
        opens them again."""
        self.leases.close()
        with self._opening:
            database, self._database = self._database, None
        if database is not None:
            database.close()
        self._files.close()  # the SQLite files it opened beside the database
