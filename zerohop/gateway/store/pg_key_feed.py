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
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

import psycopg

from zerohop.gateway.keys.identity import Identity
from zerohop.gateway.store.pg_schema import KEYS_CHANNEL
from zerohop.gateway.store.postgres import connect, keys_version, read_keys
from zerohop.gateway.store.rows import InvalidKey
from zerohop.gateway.store.spec import mask_in, mask_password, one_line

log = logging.getLogger(__name__)

APPLICATION_NAME = "zerohop-key-feed"  # in pg_stat_activity
NOTIFY_WAIT = 0.25  # seconds the listener blocks for a notification (and stop() may wait)
RECONCILE_INTERVAL = 1.0
FULL_RELOAD_INTERVAL = 600.0
BACKOFF_MIN, BACKOFF_MAX = 0.2, 5.0
TRIGGERS = ("notify", "reconcile", "reconnect", "full")

Index = dict[str, Identity | InvalidKey]
Apply = Callable[[int, Index, bool], None]  # (version, index, has_keys)


class KeyFeed:
    """Keeps an index current from PostgreSQL. `up`, `reloads` (by trigger), `errors`,
    `last_error` and `last_propagation` (notify to applied, s) are for metrics."""

    def __init__(self, url: str, loaded: Callable[[], int], apply: Apply) -> None:
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
        self._last_full = time.monotonic()

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
        version, index, has_keys = read_keys(conn)
        changed = version != self._loaded()
        self._apply(version, index, has_keys)
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
