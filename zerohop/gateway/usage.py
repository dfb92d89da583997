"""Usage and refusals per minute, for the admin API's reports and the console.

`record(call)` runs when a request ends, on the event loop: it adds the request's tokens to
an in-memory row of (minute, key, tenant, model), or its refusal to a row of (minute, key,
tenant, reason), a few dict operations. A thread of its own writes what has gathered to the
store every `interval` seconds (an upsert that adds, so replicas sharing a PostgreSQL sum
into the same rows). The request path never waits for the store; a report lags by about
`interval`.

A request a trusted front named an end user for (`--trusted-front`: `Call.end_user_email`,
else `Call.end_user`) also adds to a row of (minute, key, tenant, model, end user), written
to a table of its own (`usage_tables`), so the totals are the same with or without one. The
end user is the dimension with many values (one per developer), so its rows are bounded
twice: they exist only behind a trusted front (no one else names an end user), and each
minute attributes at most `max_end_users` distinct end users; requests of any further one
count in the totals only (under the end user "" in a report by end user).

When the store cannot be written, the rows are kept and retried at the next flush, up to
`max_rows` of them; past that the oldest are dropped and counted (`dropped`), as usage is a
report, not the budget ledger (which has its own durable path).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from zerohop.gateway.store.repositories import UsageRepository
from zerohop.gateway.store.usage_tables import USAGE_COUNTS, RefusalRow, UsageRow

log = logging.getLogger(__name__)

NOT_REFUSED = ("none", "admitted", "clamped")
MAX_MESSAGE = 300  # characters of a refusal's message kept

UsageKey = tuple[int, str, str, str, str]  # minute, key id, tenant, model, end user ("": all)
RefusalKey = tuple[int, str, str, str]  # minute, key id, tenant, reason


class UsageRecorder:
    def __init__(
        self,
        repository: UsageRepository,
        interval: float = 1.0,
        max_rows: int = 100_000,
        clock: Callable[[], float] = time.time,
        max_end_users: int = 10_000,
    ) -> None:
        if interval <= 0 or max_rows < 1 or max_end_users < 0:
            raise ValueError("interval and max_rows must be positive, max_end_users not negative")
        self.repository, self.interval, self.max_rows = repository, interval, max_rows
        self.clock, self.max_end_users = clock, max_end_users
        self._end_users: tuple[int, set[str]] = (0, set())  # this minute's, for the cap
        self._usage: dict[UsageKey, list[int]] = {}
        self._refusals: dict[RefusalKey, list[Any]] = {}  # [count, last_at, last_message]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.flushes = self.failures = self.dropped = 0

    # -- the event loop's side ----------------------------------------------------------------

    def record(self, call: Any) -> None:
        """A request ended (a `zerohop.gateway.gateway.Call`)."""
        now = self.clock()
        minute = int(now // 60 * 60)
        identity = call.identity
        who = (minute, identity.key_id, identity.tenant.name)
        with self._lock:
            if call.decision not in NOT_REFUSED:
                row = self._refusals.setdefault((*who, call.decision), [0, now, ""])
                row[0] += 1
                row[1], row[2] = now, (call.refusal or "")[:MAX_MESSAGE]
                return
            if call.prompt_tokens == 0 and call.output_tokens == 0:
                return  # never reached the engine (a bad request): not usage
            where = (*who, call.model or "")
            _add(self._usage.setdefault((*where, ""), [0] * len(USAGE_COUNTS)), call)
            end_user = self._end_user(minute, call)
            if end_user:
                _add(self._usage.setdefault((*where, end_user), [0] * len(USAGE_COUNTS)), call)

    def _end_user(self, minute: int, call: Any) -> str:
        """The end user to attribute the call to; "" for none or past the minute's cap."""
        end_user = call.end_user_email or call.end_user or ""
        if not end_user:
            return ""
        if self._end_users[0] != minute:
            self._end_users = (minute, set())
        seen = self._end_users[1]
        if end_user not in seen:
            if len(seen) >= self.max_end_users:
                return ""
            seen.add(end_user)
        return str(end_user)

    # -- the writer thread --------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="zerohop-usage", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Write what is gathered (one last try) and stop."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.flush()

    def flush(self) -> bool:
        """Write the gathered rows now; False (rows kept for the next try) on a store error."""
        with self._lock:
            usage, self._usage = self._usage, {}
            refusals, self._refusals = self._refusals, {}
        if not usage and not refusals:
            return True
        try:
            self.repository.add(_usage_rows(usage), _refusal_rows(refusals))
        except Exception as exc:  # a full disk or a store that is down: an outage, not a bug
            self.failures += 1
            log.warning("usage: writing %d rows failed (%s); kept for retry", len(usage), exc)
            self._keep(usage, refusals)
            return False
        self.flushes += 1
        return True

    def _keep(
        self, usage: dict[UsageKey, list[int]], refusals: dict[RefusalKey, list[Any]]
    ) -> None:
        with self._lock:
            for where, counts in usage.items():
                mine = self._usage.setdefault(where, [0] * len(counts))
                mine[:] = [a + b for a, b in zip(mine, counts, strict=True)]
            for why, (count, last_at, message) in refusals.items():
                kept = self._refusals.setdefault(why, [0, last_at, message])
                kept[0] += count
            self._trim(self._usage)
            self._trim(self._refusals)

    def _trim(self, table: dict[Any, Any]) -> None:
        extra = len(table) - self.max_rows
        if extra > 0:  # the oldest minutes go first
            for key in sorted(table, key=_drop_order)[:extra]:
                del table[key]
            self.dropped += extra


def _drop_order(key: tuple[Any, ...]) -> tuple[Any, ...]:
    """A minute's end-user rows go before its totals, which must stay their sum or more."""
    return key[0], len(key) < 5 or key[4] == "", key


def _add(counts: list[int], call: Any) -> None:
    counts[0] += 1
    counts[1] += (call.status or 0) >= 400
    counts[2] += call.prompt_tokens - call.cached_tokens
    counts[3] += call.cached_tokens
    counts[4] += call.output_tokens


def _usage_rows(usage: dict[UsageKey, list[int]]) -> list[UsageRow]:
    return [
        UsageRow.of((minute, key_id, tenant, model), counts, end_user)
        for (minute, key_id, tenant, model, end_user), counts in usage.items()
    ]


def _refusal_rows(refusals: dict[RefusalKey, list[Any]]) -> list[RefusalRow]:
    return [RefusalRow(*key, *row) for key, row in refusals.items()]
