"""A fleet's rate-limit shares in PostgreSQL (`zerohop.gateway.limits.fleet_shares` says what
they mean): per limited subject, each replica's share w and demand in `rate_shares`, their
sum kept <= 1 under the `rate_subjects` row's lock. `LeaseRepository` (lease_repository.py)
runs these on its own autocommit connection.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import psycopg

FLOOR = 0.05  # of each limit, split between the replicas using it: none ever starves


def allocate(demands: dict[str, float], me: str) -> float:
    """My share: a floor for each replica using the subject, the rest by demand."""
    n = len(demands)
    total = sum(demands.values())
    if total <= 0:
        return 1.0 / n
    return FLOOR / n + (1.0 - FLOOR) * demands[me] / total


def rebalance(
    conn: psycopg.Connection, replica_id: str, subject: str, demand: float, ttl: float
) -> tuple[float, bool]:
    """Take the share `demand` earns, from what the others leave free; (share, fresh):
    fresh when no replica had held a share lately (the fleet's bucket is full)."""
    with conn.transaction():
        conn.execute("INSERT INTO rate_subjects VALUES (%s) ON CONFLICT DO NOTHING", (subject,))
        conn.execute("SELECT 1 FROM rate_subjects WHERE subject = %s FOR UPDATE", (subject,))
        rows = conn.execute(
            "SELECT replica_id, share, demand, expires_at > now() FROM rate_shares"
            " WHERE subject = %s",
            (subject,),
        ).fetchall()
        live = {r[0]: (r[1], r[2]) for r in rows if r[3] and r[0] != replica_id}
        others = sum(share for share, _ in live.values())
        demands = {r: d for r, (_, d) in live.items()} | {replica_id: demand}
        share = max(0.0, min(allocate(demands, replica_id), 1.0 - others - 1e-9))
        conn.execute(
            "INSERT INTO rate_shares (subject, replica_id, share, demand, expires_at)"
            " VALUES (%s, %s, %s, %s, now() + make_interval(secs => %s))"
            " ON CONFLICT (subject, replica_id) DO UPDATE SET share = excluded.share,"
            " demand = excluded.demand, expires_at = excluded.expires_at",
            (subject, replica_id, share, demand, ttl),
        )
    return share, not rows


def give_back(conn: psycopg.Connection, replica_id: str, subject: str) -> None:
    """Drop this replica's share of `subject` (it stopped asking)."""
    conn.execute(
        "DELETE FROM rate_shares WHERE subject = %s AND replica_id = %s", (subject, replica_id)
    )
