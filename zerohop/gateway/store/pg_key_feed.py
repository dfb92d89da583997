"""Key changes from PostgreSQL within a second: a replica's key feed (`serve --store URL`).

A thread with a connection of its own (LISTEN needs one session; a pooled one would lose
it) listens on `zerohop_keys`, which every change notifies on commit. On a notification,
and every second to reconcile (a notification lost with a connection, a change made by
hand), it compares the store's `keys_version` with the loaded one and, if they differ,
reads every key in one consistent read and hands the new index to `apply`, which swaps it
in whole: the request path only ever looks up a dict and never waits on the network.

On any connection error the last index keeps serving (the keys the replica knows), and the
feed reconnects with backoff (0.2 s doubling to 5 s). It LISTENs *before* it reads, at
every (re)connection, so a change committed in between is never missed. A full reload
every 10 minutes catches rows edited by hand without a version bump.

`read_now` reads the keys once, for a replica's start-up; what the feed and it read is
what the replica keeps as its local snapshot (`zerohop.gateway.store.key_snapshot`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

import psycopg

from zerohop.gateway.store.pg_schema import KEYS_CHANNEL
from zerohop.gateway.store.postgres import check_schema, connect, keys_version, read_key_rows
from zerohop.gateway.store.rows import KeyRows
from zerohop.gateway.store.spec import StoreUnavailable, mask_in, mask_password, one_line

log = logging.getLogger(__name__)

APPLICATION_NAME = "zerohop-key-feed"  # in pg_stat_activity
NOTIFY_WAIT = 0.25  # seconds the listener blocks for a notification (and stop() may wait)
RECONCILE_INTERVAL = 1.0
FULL_RELOAD_INTERVAL = 600.0
BACKOFF_MIN, BACKOFF_MAX = 0.2, 5.0
TRIGGERS = ("notify", "reconcile", "reconnect", "full")

Apply = Callable[[KeyRows], None]


def read_now(url: str) -> KeyRows:
    """The keys as the store has them now, read once (a replica's start-up):
    StoreUnavailable when it cannot be reached, SchemaMismatch when it is not migrated."""
    try:
        with connect(url, autocommit=True, application_name=APPLICATION_NAME) as conn:
            check_schema(conn, mask_password(url))
            return read_key_rows(conn)
    except psycopg.OperationalError as exc:
        raise StoreUnavailable.wrap(exc, url) from exc


class KeyFeed:
    """Keeps an index current from PostgreSQL. `up`, `reloads` (by trigger), `errors`,
    `last_error` and `last_propagation` (notify to applied, s) are for metrics. With
    `full_first` its first read of the store is a full reload, whatever the version (the
    index it follows came from elsewhere: a local snapshot)."""

    def __init__(
        self, url: str, loaded: Callable[[], int], apply: Apply, *, full_first: bool = False
    ) -> None:
        self.url = url
        self._loaded = loaded  # the version the index holds now
        self._apply = apply
        self.up = False
        self.reloads = dict.fromkeys(TRIGGERS, 0)
        self.errors = 0
        self.last_error: str | None = None
        self.last_propagation: float | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._backoff = BACKOFF_MIN
        self._last_full = -FULL_RELOAD_INTERVAL if full_first else time.monotonic()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="zerohop-key-feed", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        trigger = "reconcile"  # the first connection's catch-up; later ones: "reconnect"
        while not self._stopping.is_set():
            try:
                self._listen(trigger)
            except Exception as exc:  # any failure: the feed must outlive it
                self._failed(exc)
                self._stopping.wait(self._backoff)
                self._backoff = min(self._backoff * 2, BACKOFF_MAX)
            trigger = "reconnect"

    def _listen(self, trigger: str) -> None:
        with connect(self.url, autocommit=True, application_name=APPLICATION_NAME) as conn:
            conn.execute(f"LISTEN {KEYS_CHANNEL}")
            self._catch_up(conn, trigger)
            if not self.up:
                log.info("keys: following %s", mask_password(self.url))
            self.up, self._backoff = True, BACKOFF_MIN
            checked = time.monotonic()
            while not self._stopping.is_set():
                notes = list(conn.notifies(timeout=NOTIFY_WAIT, stop_after=1))
                if notes:
                    self._catch_up(conn, "notify", notes[-1].payload)
                elif time.monotonic() - checked < RECONCILE_INTERVAL:
                    continue
                else:
                    self._catch_up(conn, "reconcile")
                checked = time.monotonic()

    def _catch_up(self, conn: psycopg.Connection, trigger: str, payload: str = "") -> None:
        """Reload when the store's version is not the loaded one (or a full reload is due)."""
        full = time.monotonic() - self._last_full >= FULL_RELOAD_INTERVAL
        if keys_version(conn) == self._loaded() and not full:
            return
        rows = read_key_rows(conn)
        changed = rows.version != self._loaded()
        self._apply(rows)
        self._last_full = time.monotonic()
        self.reloads[trigger if changed else "full"] += 1
        if trigger == "notify":
            self.last_propagation = _sent_ago(payload)

    def _failed(self, exc: Exception) -> None:
        self.errors += 1
        self.last_error = mask_in(one_line(exc), self.url)
        if self.up or self.errors == 1:  # once per outage: the retries say nothing new
            log.warning(
                "keys: the store %s cannot be read (%s): serving the last keys loaded, retrying",
                mask_password(self.url),
                self.last_error,
            )
        if not isinstance(exc, psycopg.Error):
            log.exception("keys: the key feed failed")
        self.up = False


def _sent_ago(payload: str) -> float | None:
    """Seconds since the change's sender stamped it (wall clocks: approximate)."""
    try:
        return max(0.0, time.time() - float(json.loads(payload)["t"]))
    except (ValueError, TypeError, KeyError):
        return None  # a NOTIFY sent by hand
