"""The server's own signing keys: HMAC secrets for what the server signs and later checks
(the thoughts of thinking blocks), kept in the key store so that every replica of a fleet
and every restart verify each other's signatures (zerohop.gateway.store.signing_keys).

- One set of keys per purpose. The newest key signs; once it is `rotation` old (7 days by
  default, `--signing-key-rotation`), the next keyring asked for makes a new one first. A
  replaced key still verifies for `overlap` after its successor was made (one rotation by
  default), then it is expired, and deleted at a later rotation: a signature verifies for
  at least `overlap` (rotation + overlap for one made with a key when it was new).
- Making a key is an insert-if-absent of the next generation, so replicas that rotate at once
  (or start at once, with no key yet) make one between them, and all sign with it.
- Keys are read when first needed and kept in memory. The store is read again only to
  rotate, and when a signature names a key id this process does not know (a key another
  replica has just made), each unknown id at most once per MISS_INTERVAL: otherwise a
  request never waits on the store.
- The store unreadable: the keys last read go on signing and verifying; a process that has
  read none signs with a key of its own, which only it verifies (logged), and it tries the
  store again after RETRY_INTERVAL. Its own key verifies for `overlap` after that.
- An operator key (`operator_secret`; for thoughts, ZEROHOP_REASONING_SECRET) signs instead
  of the store's keys and never rotates: every replica must be given the same one, and
  replacing it is its rotation (what the old one signed then no longer verifies). No key is
  made in the store meanwhile; the store's keys still verify what they signed until they
  expire (the newest counts as replaced `rotation` after it was made).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import logging
import math
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from zerohop.gateway.store.repositories import SigningKeyRepository
from zerohop.gateway.store.signing_keys import SigningKeyRow

log = logging.getLogger(__name__)

DEFAULT_ROTATION = 7 * 86_400.0  # seconds: 7 days
MIN_ROTATION = 60.0  # seconds; less would make a key every few requests
RETRY_INTERVAL = 5.0  # seconds after a failed read before the store is tried again
MISS_INTERVAL = 10.0  # seconds before an unknown key id is looked up again
MAX_MISSES = 1024  # unknown key ids remembered (then forgotten all at once)
SECRET_BYTES = 32


@dataclass(slots=True, frozen=True)
class SigningKey:
    key_id: str
    secret: bytes = field(repr=False)
    created: float
    retired: float | None = None  # when a newer key took over signing; None: it signs

    def verifies_at(self, now: float, overlap: float) -> bool:
        return self.retired is None or now < self.retired + overlap


@dataclass(slots=True, frozen=True)
class Keyring:
    """The keys as last read: `signing` signs, `find` gives the key of an id while it
    verifies. `complete` False: the store could not be read the last time it was tried."""

    signing: SigningKey
    keys: dict[str, SigningKey]
    overlap: float
    complete: bool = True

    def find(self, key_id: str, now: float) -> SigningKey | None:
        key = self.keys.get(key_id)
        return key if key is not None and key.verifies_at(now, self.overlap) else None


def check_rotation(seconds: float) -> float:
    if not (math.isfinite(seconds) and seconds >= MIN_ROTATION):
        raise ValueError(f"signing key rotation: must be >= {MIN_ROTATION:g} s, not {seconds!r}")
    return seconds


def operator_key(secret: bytes) -> SigningKey:
    """The key an operator gives: its id is derived from it (a replaced secret's signatures
    name an id no replica knows any more)."""
    digest = hmac.new(secret, b"zerohop signing key id", hashlib.sha256).hexdigest()
    return SigningKey("op" + digest[:8], secret, 0.0)


def new_row(purpose: str, generation: int, now: float) -> SigningKeyRow:
    return SigningKeyRow(
        purpose, generation, secrets.token_hex(4), secrets.token_hex(SECRET_BYTES), now
    )


def first_kept(rows: list[SigningKeyRow], now: float, overlap: float) -> int:
    """The oldest generation of `rows` (oldest first) that still verifies at `now`."""
    for row, successor in itertools.pairwise(rows):
        if now < successor.created + overlap:
            return row.generation
    return rows[-1].generation


class ServerKeys:
    """One purpose's keys (module docstring). `repository`: the store's signing keys (read in
    a worker thread, one refresh at a time); None: no store, a key of this process's own."""

    def __init__(
        self,
        repository: SigningKeyRepository | None,
        purpose: str,
        *,
        rotation: float = DEFAULT_ROTATION,
        overlap: float | None = None,
        operator_secret: bytes | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.purpose, self.clock = purpose, clock
        self.rotation = check_rotation(rotation)
        self.overlap = rotation if overlap is None else overlap
        self.operator = operator_key(operator_secret) if operator_secret else None
        self.repository = repository
        self._refreshing = asyncio.Lock()
        self._ring: Keyring | None = None
        self._own: SigningKey | None = None  # made while the store could not be read
        self._failed_at = -math.inf
        self._misses: dict[str, float] = {}  # unknown key id -> when it was looked up

    async def keyring(self, wanted: Iterable[str] = ()) -> Keyring:
        """The keys, read (or rotated) first when needed; `wanted`: the key ids the caller
        will look up (an unknown one is looked up in the store)."""
        ids = list(wanted)
        if self._due(self.clock(), ids):
            async with self._refreshing:
                now = self.clock()
                if self._due(now, ids):  # unless a request before this one did it
                    await asyncio.to_thread(self._refresh, now, ids)
        assert self._ring is not None
        return self._ring

    def _due(self, now: float, wanted: list[str]) -> bool:
        ring = self._ring
        if ring is None:
            return True
        if self.repository is None or now - self._failed_at < RETRY_INTERVAL:
            return False
        if not ring.complete:
            return True
        if self.operator is None and ring.signing.created <= now - self.rotation:
            return True
        never = -math.inf
        return any(
            k not in ring.keys and now - self._misses.get(k, never) >= MISS_INTERVAL for k in wanted
        )

    def _refresh(self, now: float, wanted: list[str]) -> None:
        """(In a worker thread.) Read the keys, rotating when due; on failure, go on with
        the keys last read or a key of this process's own."""
        if self.repository is None:
            self._ring = self._own_ring(now, complete=True)
            return
        try:
            rows = self._read(self.repository, now)
        except Exception as exc:
            self._failed_at = now
            log.warning("signing keys (%s): the store cannot be read now: %s", self.purpose, exc)
            self._ring = self._fallback(now)
        else:
            self._failed_at = -math.inf
            self._ring = self._ring_of(rows, now)
        if len(self._misses) > MAX_MISSES:
            self._misses.clear()
        for key_id in wanted:
            if key_id not in self._ring.keys:
                self._misses[key_id] = now

    def _read(self, store: SigningKeyRepository, now: float) -> list[SigningKeyRow]:
        """The keys that verify now, a new generation made first when rotation is due (a
        replica racing this one makes the same generation: the store keeps one of them)."""
        rows = store.keys(self.purpose)
        if self.operator is not None or (rows and rows[-1].created > now - self.rotation):
            return rows
        generation = rows[-1].generation + 1 if rows else 1
        if store.add(new_row(self.purpose, generation, now)):
            log.info("signing keys (%s): made generation %d", self.purpose, generation)
        rows = store.keys(self.purpose)
        if not rows:
            raise RuntimeError("no signing key in the store right after one was added")
        kept = first_kept(rows, now, self.overlap)
        if kept > rows[0].generation:
            store.drop(self.purpose, kept)
        return [r for r in rows if r.generation >= kept]

    def _ring_of(self, rows: list[SigningKeyRow], now: float) -> Keyring:
        keys = {}
        for row, successor in zip(rows, [*rows[1:], None], strict=True):
            retired = successor.created if successor is not None else None
            if retired is None and self.operator is not None:
                retired = row.created + self.rotation
            secret = bytes.fromhex(row.secret)
            keys[row.key_id] = SigningKey(row.key_id, secret, row.created, retired)
        if self._own is not None:  # what it signed during the outage verifies for the overlap
            if self._own.retired is None:
                self._own = replace(self._own, retired=now)
            keys[self._own.key_id] = self._own
        if self.operator is not None:
            keys[self.operator.key_id] = self.operator
        signing = self.operator or keys[rows[-1].key_id]  # without one, _read made a key
        return Keyring(signing, keys, self.overlap)

    def _fallback(self, now: float) -> Keyring:
        ring = self._ring
        if ring is not None:
            return replace(ring, complete=False)
        if self.operator is not None:
            operator = self.operator
            return Keyring(operator, {operator.key_id: operator}, self.overlap, complete=False)
        log.warning(
            "signing keys (%s): signing with a key of this process's own until the store can"
            " be read: what it signs verifies on this process only",
            self.purpose,
        )
        return self._own_ring(now, complete=False)

    def _own_ring(self, now: float, complete: bool) -> Keyring:
        if self._own is None:
            self._own = SigningKey(secrets.token_hex(4), secrets.token_bytes(SECRET_BYTES), now)
        return Keyring(self._own, {self._own.key_id: self._own}, self.overlap, complete)
