"""Budget leases in PostgreSQL: the transactions, one per lease change, the heartbeat, the
sweep and a replica's goodbye. `LeaseRepository` (lease_repository.py) runs them on its own
connection, in autocommit mode as every connection given to this module.

Per (subject, period), `budget_state.settled` is spend the replicas reported final and
`leased` is what they were granted and have not reported yet (Σ granted − settled over the
active leases). Every transaction here keeps, for the budget `limit` it is given:

    settled + leased <= limit        (granting only from limit − settled − leased)

A replica spends only inside what it was granted and only before its local deadline, which
ends before PostgreSQL's `expires_at`; so whatever happens to a replica, the fleet spends no
more than `settled + leased`. Locks are always taken `budget_state` first, then `leases`, so
replicas and sweepers never deadlock. Values a replica sends are absolute (what it has spent
on the lease in all, what it holds), so a retry after an unknown outcome changes nothing.

An expired lease (its replica stopped renewing it: killed, or cut off) is charged, not
freed: the sweep cannot tell a dead replica from one that is still spending it, so its
unreported remainder moves to `settled`. The budget stays safe; a dead replica's unused
slice is lost to its period, which is why slices are sized from recent spend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import psycopg

SWEEP_BATCH = 100  # expired leases charged per sweep


@dataclass(slots=True, frozen=True)
class LeaseChange:
    """What a replica asks of one lease: report spend, give some back, take more, or end it."""

    subject: str
    period: str
    limit: int  # the budget as the replica's key index has it now
    lease_id: int | None  # the replica's active lease; None: open one
    spent: int = 0  # tokens spent on this lease in all, final (absolute)
    give_back: int = 0  # unused tokens the replica already stopped counting as its own
    want: int = 0  # tokens wanted on top
    share: float = 1.0  # at most this part of what is free (0.5: leave some for others)
    close: bool = False  # end the lease: `spent` is final, the rest goes back
    at_least: int = 0  # grant nothing rather than less than this (too little to use)


@dataclass(slots=True, frozen=True)
class LeaseReply:
    lease_id: int | None  # None: the lease is gone (expired, swept) or closed
    granted: int  # the lease's granted tokens in all, after this change
    added: int  # granted by this change
    free: int  # limit − settled − leased after it (< 0: the budget was lowered)
    held_elsewhere: int  # tokens other replicas hold on this budget, unreported
    lost: bool = False  # the lease had expired: nothing here changed it


def change(conn: psycopg.Connection, replica_id: str, c: LeaseChange, ttl: float) -> LeaseReply:
    """Apply one lease change in one transaction; see the module's invariant."""
    with conn.transaction():
        conn.execute(
            "INSERT INTO budget_state (subject, period) VALUES (%s, %s) ON CONFLICT DO NOTHING",
            (c.subject, c.period),
        )
        settled, leased = _one(
            conn,
            "SELECT settled, leased FROM budget_state WHERE subject = %s AND period = %s"
            " FOR UPDATE",
            (c.subject, c.period),
        )
        granted, reported = 0, 0
        if c.lease_id is not None:
            row = conn.execute(
                "SELECT granted, settled, state FROM leases WHERE lease_id = %s FOR UPDATE",
                (c.lease_id,),
            ).fetchone()
            if row is None or row[2] != "active":
                return LeaseReply(None, 0, 0, c.limit - settled - leased, leased, lost=True)
            granted, reported = row[0], row[1]
        spent = min(max(c.spent, reported), granted)  # never backwards, never past granted
        settled, leased = settled + spent - reported, leased - (spent - reported)
        give_back = min(max(c.give_back, 0), granted - spent)
        if c.close:
            give_back = granted - spent
        granted, leased = granted - give_back, leased - give_back
        free = c.limit - settled - leased
        added = 0 if c.close else max(0, min(c.want, int(free * c.share)))
        if added < c.at_least:
            added = 0
        granted, leased = granted + added, leased + added
        lease_id = _write_lease(conn, replica_id, c, granted, spent, ttl)
        conn.execute(
            "UPDATE budget_state SET settled = %s, leased = %s WHERE subject = %s AND period = %s",
            (settled, leased, c.subject, c.period),
        )
        held_elsewhere = leased - (granted - spent)
        return LeaseReply(lease_id, granted, added, free - added, held_elsewhere)


def _write_lease(
    conn: psycopg.Connection, replica_id: str, c: LeaseChange, granted: int, spent: int, ttl: float
) -> int | None:
    if c.lease_id is None:
        if c.close or granted == 0:
            return None
        (lease_id,) = _one(
            conn,
            "INSERT INTO leases (replica_id, subject, period, granted, expires_at)"
            " VALUES (%s, %s, %s, %s, now() + make_interval(secs => %s)) RETURNING lease_id",
            (replica_id, c.subject, c.period, granted, ttl),
        )
        return int(lease_id)
    state = "returned" if c.close else "active"
    conn.execute(
        "UPDATE leases SET granted = %s, settled = %s, state = %s,"
        " expires_at = now() + make_interval(secs => %s) WHERE lease_id = %s",
        (granted, spent, state, ttl, c.lease_id),
    )
    return None if c.close else c.lease_id


@dataclass(slots=True, frozen=True)
class Beat:
    # lease id -> (settled, leased) of its budget, for each lease renewed (one missing was
    # swept: stop using it)
    renewed: dict[int, tuple[int, int]]
    keys_version: int
    replicas: int  # live replicas, this one included


def heartbeat(
    conn: psycopg.Connection, replica_id: str, ttl: float, host: str, version: str
) -> Beat:
    """Renew this replica and every active lease and rate share of it for `ttl` seconds."""
    with conn.transaction():
        conn.execute(
            "INSERT INTO replicas (replica_id, host, zerohop, expires_at)"
            " VALUES (%s, %s, %s, now() + make_interval(secs => %s))"
            " ON CONFLICT (replica_id) DO UPDATE SET heartbeat_at = now(),"
            " expires_at = excluded.expires_at",
            (replica_id, host, version, ttl),
        )
        rows = conn.execute(
            "UPDATE leases l SET expires_at = now() + make_interval(secs => %s)"
            " FROM budget_state b WHERE l.replica_id = %s AND l.state = 'active'"
            " AND b.subject = l.subject AND b.period = l.period"
            " RETURNING l.lease_id, b.settled, b.leased",
            (ttl, replica_id),
        ).fetchall()
        conn.execute(
            "UPDATE rate_shares SET expires_at = now() + make_interval(secs => %s)"
            " WHERE replica_id = %s",
            (ttl, replica_id),
        )
        (keys_version,) = _one(conn, "SELECT value FROM store_meta WHERE name = 'keys_version'")
        (replicas,) = _one(conn, "SELECT count(*) FROM replicas WHERE expires_at > now()")
    return Beat({r[0]: (r[1], r[2]) for r in rows}, keys_version, replicas)


def sweep(conn: psycopg.Connection) -> list[tuple[str, str, int]]:
    """Charge the leases that expired: (subject, period, tokens charged) of each."""
    due = conn.execute(
        "SELECT lease_id, subject, period FROM leases"
        " WHERE state = 'active' AND expires_at < now() LIMIT %s",
        (SWEEP_BATCH,),
    ).fetchall()
    charged = []
    for lease_id, subject, period in due:
        tokens = _charge(conn, lease_id, subject, period)
        if tokens is not None:
            charged.append((subject, period, tokens))
    with conn.transaction():
        conn.execute("DELETE FROM replicas WHERE expires_at < now()")
        # Kept a minute past expiry: a share granted meanwhile starts empty, as the fleet's
        # bucket may still be spent (rate_share_tables.py).
        conn.execute("DELETE FROM rate_shares WHERE expires_at < now() - interval '60 s'")
    return charged


def forget_replica(conn: psycopg.Connection, replica_id: str) -> None:
    """A replica's goodbye, its leases returned: its rate shares and its row go now."""
    with conn.transaction():
        conn.execute("DELETE FROM rate_shares WHERE replica_id = %s", (replica_id,))
        conn.execute("DELETE FROM replicas WHERE replica_id = %s", (replica_id,))


def _charge(conn: psycopg.Connection, lease_id: int, subject: str, period: str) -> int | None:
    with conn.transaction():
        conn.execute(
            "SELECT 1 FROM budget_state WHERE subject = %s AND period = %s FOR UPDATE",
            (subject, period),
        )
        row = conn.execute(
            "SELECT granted - settled FROM leases WHERE lease_id = %s AND state = 'active'"
            " AND expires_at < now() FOR UPDATE",
            (lease_id,),
        ).fetchone()
        if row is None:  # renewed or ended meanwhile
            return None
        (tokens,) = row
        conn.execute(
            "UPDATE leases SET state = 'expired', settled = granted WHERE lease_id = %s",
            (lease_id,),
        )
        conn.execute(
            "UPDATE budget_state SET settled = settled + %s, leased = leased - %s"
            " WHERE subject = %s AND period = %s",
            (tokens, tokens, subject, period),
        )
        return int(tokens)


def _one(conn: psycopg.Connection, sql: str, params: tuple[object, ...] = ()) -> tuple[Any, ...]:
    row = conn.execute(sql, params).fetchone()
    assert row is not None, sql
    return row
