"""Lines: taken in turn from each tenant, marked running, requeued, answered once."""

from __future__ import annotations

import json
import time
from collections import defaultdict, deque
from collections.abc import Iterable, Iterator
from typing import Any

from zerohop.api.errors import ApiError
from zerohop.batches.records import (
    ERRORED,
    FINISHED,
    IN_PROGRESS,
    MAX_LINE_ATTEMPTS,
    RUNNING,
    WAITING,
    DuplicateCustomId,
    LineRecord,
    NewLine,
    RequestCounts,
    WaitingLine,
)
from zerohop.batches.results import api_of, refused
from zerohop.batches.schema import _LINE_COLUMNS, Connection, Statements, _dumps, _line, _loads


class LineTable(Connection):
    # A line's columns when it goes back to waiting (the PostgreSQL store clears its lease too).
    _waiting_again = "state = ?, started_at = NULL"

    def next_waiting(self, limit: int, *, exclude: Iterable[str] = ()) -> list[WaitingLine]:
        """Up to `limit` waiting lines of in-progress batches, taken in turn from each tenant
        (the tenant with the fewest running lines first), each tenant's oldest batch first
        and its lines in order. `exclude`: tenants not to take from now (backing off)."""
        skip = set(exclude)
        per_tenant: dict[str, deque[WaitingLine]] = defaultdict(deque)
        with self._lock:
            for batch in self.conn.execute(
                "SELECT id, tenant, key_id, endpoint, identity FROM batches WHERE status = ?"
                " ORDER BY seq",
                (IN_PROGRESS,),
            ).fetchall():
                queue = per_tenant[batch["tenant"]]
                if batch["tenant"] in skip or len(queue) >= limit:
                    continue
                rows = self.conn.execute(
                    f"SELECT {_LINE_COLUMNS} FROM lines WHERE batch_id = ? AND state = ?"
                    " ORDER BY idx LIMIT ?",
                    (batch["id"], WAITING, limit - len(queue)),
                )
                tenant, key_id, endpoint = batch["tenant"], batch["key_id"], batch["endpoint"]
                identity = _loads(batch["identity"])
                queue.extend(
                    WaitingLine(_line(r), tenant, key_id, endpoint, identity) for r in rows
                )
            running = self._running_by_tenant()
        return _take_in_turn(per_tenant, running, limit)

    def _running_by_tenant(self) -> dict[str, int]:
        rows = self.conn.execute(
            "SELECT b.tenant, COUNT(*) FROM lines AS l JOIN batches AS b ON b.id = l.batch_id"
            " WHERE l.state = 'running' GROUP BY b.tenant"  # literal: the partial index
        )
        return {tenant: n for tenant, n in rows}

    def mark_running(self, batch_id: str, index: int, now: float | None = None) -> bool:
        """waiting -> running; False when the line is no longer waiting (canceled, expired)."""
        now = time.time() if now is None else now
        with self._transaction() as conn:
            done = conn.execute(
                "UPDATE lines SET state = ?, started_at = ?, attempts = attempts + 1"
                " WHERE batch_id = ? AND idx = ? AND state = ?",
                (RUNNING, now, batch_id, index, WAITING),
            )
        return done.rowcount == 1

    def requeue(self, batch_id: str, index: int) -> bool:
        """running -> waiting: the runner gave the line back (shutdown, a retryable refusal)."""
        with self._transaction() as conn:
            done = conn.execute(
                f"UPDATE lines SET {self._waiting_again}"
                " WHERE batch_id = ? AND idx = ? AND state = ?",
                (WAITING, batch_id, index, RUNNING),
            )
        return done.rowcount == 1

    def _settle_abandoned(
        self, conn: Statements, where: str, params: tuple[object, ...], now: float
    ) -> int:
        """Running lines that nobody runs any more (`where` picks them): waiting again, or
        errored once they were started MAX_LINE_ATTEMPTS times, so that a line that brings
        the server down every time it runs does not run forever. How many were settled."""
        abandoned = conn.execute(
            "SELECT l.batch_id, l.idx, l.attempts, b.endpoint FROM lines AS l"
            f" JOIN batches AS b ON b.id = l.batch_id WHERE l.state = 'running' AND {where}",
            params,
        ).fetchall()
        for batch_id, index, attempts, endpoint in abandoned:
            sql, args = self._waiting_again, list[Any]([WAITING])
            if attempts >= MAX_LINE_ATTEMPTS:
                result = _abandoned_result(attempts, endpoint)
                sql, args = "state = ?, result = ?, finished_at = ?", [ERRORED, result, now]
            conn.execute(
                f"UPDATE lines SET {sql} WHERE batch_id = ? AND idx = ? AND state = ?",
                (*args, batch_id, index, RUNNING),
            )
        return len(abandoned)

    def record_result(
        self, batch_id: str, index: int, state: str, result: Any, now: float | None = None
    ) -> bool:
        """Finish a line with its result, once: False if it had finished already."""
        if state not in FINISHED:
            raise ValueError(f"a result's state is one of {', '.join(FINISHED)}, not {state!r}")
        now = time.time() if now is None else now
        with self._transaction() as conn:
            done = conn.execute(
                "UPDATE lines SET state = ?, result = ?, finished_at = ?"
                " WHERE batch_id = ? AND idx = ? AND state IN (?, ?)",
                (state, _dumps(result), now, batch_id, index, WAITING, RUNNING),
            )
        return done.rowcount == 1

    def line(self, batch_id: str, index: int) -> LineRecord | None:
        with self._lock:
            row = self.conn.execute(
                f"SELECT {_LINE_COLUMNS} FROM lines WHERE batch_id = ? AND idx = ?",
                (batch_id, index),
            ).fetchone()
        return None if row is None else _line(row)

    def lines(self, batch_id: str, *, after: int = -1, limit: int = 1000) -> list[LineRecord]:
        """A batch's lines in order, a page at a time (`after`: the last index seen), so a
        finalizer reading 100,000 results never holds the lock for long."""
        with self._lock:
            rows = self.conn.execute(
                f"SELECT {_LINE_COLUMNS} FROM lines WHERE batch_id = ? AND idx > ?"
                " ORDER BY idx LIMIT ?",
                (batch_id, after, limit),
            ).fetchall()
        return [_line(r) for r in rows]

    def line_pages(self, batch_id: str, limit: int = 1000) -> Iterator[list[LineRecord]]:
        """A batch's lines in order, `limit` at a time (`lines` page after page)."""
        after = -1
        while page := self.lines(batch_id, after=after, limit=limit):
            yield page
            after = page[-1].index

    def tenant_line_counts(self) -> dict[str, RequestCounts]:
        """Every tenant's stored lines by state (for /metrics' counters, read once at start)."""
        counts: dict[str, RequestCounts] = defaultdict(RequestCounts)
        with self._lock:
            rows = self.conn.execute(
                "SELECT b.tenant, l.state, COUNT(*) FROM lines AS l"
                " JOIN batches AS b ON b.id = l.batch_id GROUP BY b.tenant, l.state"
            ).fetchall()
        for tenant, state, n in rows:
            setattr(counts[tenant], state, n)
        return dict(counts)

    def counts(self, batch_id: str) -> RequestCounts:
        with self._lock:
            rows = self.conn.execute(
                "SELECT state, COUNT(*) FROM lines WHERE batch_id = ? GROUP BY state", (batch_id,)
            ).fetchall()
        return RequestCounts(**{state: n for state, n in rows})


def _abandoned_result(attempts: int, endpoint: str) -> str | None:
    message = (
        f"this line was running when the server stopped, {attempts} times: it is not run again"
    )
    return _dumps(refused(ApiError(500, message), api_of(endpoint)))


def _take_in_turn(
    per_tenant: dict[str, deque[WaitingLine]], running: dict[str, int], limit: int
) -> list[WaitingLine]:
    tenants = sorted((t for t, q in per_tenant.items() if q), key=lambda t: running.get(t, 0))
    taken: list[WaitingLine] = []
    while tenants and len(taken) < limit:
        for tenant in list(tenants):
            queue = per_tenant[tenant]
            taken.append(queue.popleft())
            if not queue:
                tenants.remove(tenant)
            if len(taken) == limit:
                break
    return taken


def _line_rows(batch_id: str, lines: Iterable[NewLine], now: float) -> Iterator[tuple[Any, ...]]:
    seen: set[str] = set()
    for index, new in enumerate(lines):
        if new.custom_id in seen:
            raise DuplicateCustomId(new.custom_id)
        if new.state not in (WAITING, *FINISHED):
            raise ValueError(f"a new line is waiting or finished, not {new.state!r}")
        seen.add(new.custom_id)
        finished = None if new.state == WAITING else now
        params = new.params if isinstance(new.params, str) else json.dumps(new.params)
        yield batch_id, index, new.custom_id, params, new.state, _dumps(new.result), finished
