"""A fleet replica's budget leases and rate shares, as the lease keeper's thread keeps them
(`zerohop.gateway.budgets.lease_keeper`): the store's `leases` repository.

Unlike the other repositories it does not use the store's pool (`PostgresStore.pool`): it
holds one dedicated autocommit connection, opened on first use with the application name
`zerohop-leases` (pg_stat_activity shows it), opened again after a call that failed, and
closed by `close` (the Store's close). This is the one consumer with a connection of its own,
and on purpose: the heartbeat renews this replica's leases, and were it to wait behind
request-path work for a pooled connection, the leases would expire and the fleet would
charge them. Only the keeper's one thread uses it, so it needs no lock.

Errors are psycopg's (`psycopg.Error`), which the keeper's backoff catches; a call that
raised one has closed the connection, so the next call starts on a fresh one. On a SQLite
store the repository exists but is never used: a call raises `NotAFleetStore`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zerohop.gateway.store import lease_tables, rate_share_tables
from zerohop.gateway.store.lease_tables import Beat, LeaseChange, LeaseReply

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import TypeVar

    import psycopg

    _T = TypeVar("_T")

APPLICATION_NAME = "zerohop-leases"  # in pg_stat_activity


class NotAFleetStore(ValueError):
    """Leases were asked of a store that is not a fleet's PostgreSQL (a SQLite file)."""


class LeaseRepository:
    """The leases' and rate shares' transactions on one connection of their own."""

    def __init__(self, url: str | None, description: str = "the store") -> None:
        self._url, self._description = url, description  # url None: not a fleet's store
        self._conn: psycopg.Connection | None = None

    # -- leases ----------------------------------------------------------------------------------

    def heartbeat(self, replica_id: str, ttl: float, host: str, version: str) -> Beat:
        """Renew this replica and every active lease and rate share of it for `ttl` seconds."""
        return self._run(lambda c: lease_tables.heartbeat(c, replica_id, ttl, host, version))

    def change(self, replica_id: str, change: LeaseChange, ttl: float) -> LeaseReply:
        """Apply one lease change in one transaction (lease_tables.change)."""
        return self._run(lambda c: lease_tables.change(c, replica_id, change, ttl))

    def sweep(self) -> list[tuple[str, str, int]]:
        """Charge the leases that expired: (subject, period, tokens charged) of each."""
        return self._run(lease_tables.sweep)

    def forget_replica(self, replica_id: str) -> None:
        """A replica's goodbye, once its leases are returned: its rate shares and row go."""
        self._run(lambda c: lease_tables.forget_replica(c, replica_id))

    # -- rate shares -------------------------------------------------------------------------

    def rebalance(
        self, replica_id: str, subject: str, demand: float, ttl: float
    ) -> tuple[float, bool]:
        """The share of `subject` that `demand` earns (rate_share_tables.rebalance)."""
        return self._run(lambda c: rate_share_tables.rebalance(c, replica_id, subject, demand, ttl))

    def give_back_share(self, replica_id: str, subject: str) -> None:
        self._run(lambda c: rate_share_tables.give_back(c, replica_id, subject))

    # -- the connection ----------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection if it is open; a later call opens it again."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _run(self, work: Callable[[psycopg.Connection], _T]) -> _T:
        import psycopg

        try:
            return work(self._connection())
        except psycopg.Error:
            self.close()  # broken, or inside a transaction it may not have ended
            raise

    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            if self._url is None:
                raise NotAFleetStore(
                    f"{self._description} is not a PostgreSQL store: budget leases and rate"
                    " shares need a fleet's store (--store postgresql://...)"
                )
            from zerohop.gateway.store.postgres import connect

            self._conn = connect(self._url, autocommit=True, application_name=APPLICATION_NAME)
        return self._conn
