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
use (see `repositories`), so consumers share it without a lock of their own. The one
exception: a fleet's budget leases keep a connection of their own (`lease_repository` says
why), which `close` closes too.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from zerohop.gateway.store.lease_repository import LeaseRepository
from zerohop.gateway.store.open_store import Database, open_database
from zerohop.gateway.store.repositories import (
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

IN_MEMORY = ":memory:"


class Store:
    """One database, opened on first use, and its repositories."""

    def __init__(
        self, open_: Opener, description: str = "the store", leases: LeaseRepository | None = None
    ) -> None:
        self._open, self._description = open_, description
        self._database: Database | None = None
        self._opening = threading.Lock()
        self._failed: tuple[float, Exception] | None = None  # the last failed open: when, why
        self.keys = KeyRepository(self.database)
        self.ledger = LedgerRepository(self.database)
        self.usage = UsageRepository(self.database)
        self.threads = ThreadRepository(self.database)
        self.responses = ResponseRepository(self.database)
        self.sessions = SessionRepository(self.database)
        self.signing_keys = SigningKeyRepository(self.database)
        # A fleet's budget leases and rate shares, on a connection of their own (see
        # lease_repository); on a SQLite store a call raises NotAFleetStore.
        self.leases = leases if leases is not None else LeaseRepository(None, description)

    @classmethod
    def of(cls, spec: StoreSpec) -> Store:
        """The store `spec` names (StoreUnavailable from a call while it cannot be opened)."""
        return cls(lambda: open_database(spec), spec.describe(), LeaseRepository.of(spec))

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
