"""Authentication: the key a request carries, looked up in memory, or a signed token.

The store's keys are held in a dict from secret hash to Identity, swapped whole when the
store changes (a SQLite file is polled every half second off the event loop; a PostgreSQL
store is followed by `key_feed.KeyFeed`'s thread), so a lookup takes no lock and touches
no disk or network. With no key in the store and no signing key configured, every caller is
anonymous (the server only allows that on loopback, or with --allow-anonymous).

A key whose row in the store (or whose tenant's row) holds an invalid value, written by an
older version or by hand, is not served and does not stop the others: each load logs the
row and field once, and a request with that key gets 403 "this key's configuration is
invalid" naming the fields (`InvalidKeyConfiguration`), until the operator fixes the row
with `zerohop keys update` or `zerohop keys tenant`.

A revoked key stays in the index as a `RevokedKey`: its request is refused with the words an
unknown key gets, and the refusal carries the key's `KeyRef` (as does an expired key's, an
invalid one's and a signed key's whose signature verified), so the audit names the key.
Nothing of an unknown secret is kept or logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from zerohop.gateway.keys.identity import ANONYMOUS, Identity, KeyRef
from zerohop.gateway.store.repositories import KeyRepository
from zerohop.gateway.store.rows import InvalidKey, KeyEntry, RevokedKey
from zerohop.gateway.store.spec import StoreSpec
from zerohop.gateway.store.sqlite import hash_secret

if TYPE_CHECKING:
    from zerohop.gateway.keys.signed_tokens import SignedKeyVerifier
    from zerohop.gateway.store.key_snapshot import LocalCopy
    from zerohop.gateway.store.pg_key_feed import KeyFeed
    from zerohop.gateway.store.rows import KeyRows

log = logging.getLogger(__name__)
RELOAD_INTERVAL = 0.5  # seconds: store changes are live within a second
UNKNOWN_KEY = "invalid API key (unknown or revoked)"


class AuthenticationError(Exception):
    """No key, an unknown key, a revoked or an expired one (401). `key`: the known key it
    was, for the audit (the message says no more than it did without it)."""

    def __init__(self, message: str, key: KeyRef | None = None) -> None:
        super().__init__(message)
        self.key = key


class PermissionDenied(Exception):
    """A valid key that may not use this model (403)."""


class InvalidKeyConfiguration(PermissionDenied):
    """A known key whose stored configuration is invalid (403; the log names the row)."""

    def __init__(self, message: str, key: KeyRef) -> None:
        super().__init__(message)
        self.key = key


@dataclass(slots=True, frozen=True)
class _Keys:
    """What one load of the store gave: swapped whole, in one assignment, from any thread."""

    version: int
    index: dict[str, KeyEntry]  # secret hash -> the key
    by_id: dict[str, KeyEntry]  # key id -> the key
    has_keys: bool  # any key in the store, revoked ones included


_NOT_LOADED = _Keys(-1, {}, {}, False)


class Authenticator:
    """The store's keys in memory. A SQLite store is polled every RELOAD_INTERVAL; a
    PostgreSQL one is followed by a `KeyFeed` thread (LISTEN/NOTIFY plus reconciliation),
    and each read of it is kept in `local_copy`, if given, to start from while it is down
    (`zerohop.gateway.store.key_snapshot`). `keys`: the process's key repository (a SQLite
    store is read through it); without one, a store of its own, closed by `close`."""

    def __init__(
        self,
        store: StoreSpec | Path,
        keys: KeyRepository,
        verifier: SignedKeyVerifier | None = None,
        local_copy: LocalCopy | None = None,
    ) -> None:
        self.spec = store if isinstance(store, StoreSpec) else StoreSpec.sqlite(store)
        self.verifier = verifier
        self.local_copy = local_copy  # PostgreSQL only
        self._keys = _NOT_LOADED
        self.repository = keys
        self._task: asyncio.Task[None] | None = None
        self.feed: KeyFeed | None = None  # PostgreSQL only, once watching

    @property
    def keys_configured(self) -> bool:
        return self._keys.has_keys or self.verifier is not None

    @property
    def version(self) -> int:
        """The store version of the keys served now (-1 before the first load)."""
        return self._keys.version

    def describe(self) -> str:
        """The key store, for people (a password masked)."""
        return self.spec.describe()

    @property
    def snapshot_served(self) -> LocalCopy | None:
        """The local snapshot while its keys are served (the store not read since start-up)."""
        local = self.local_copy
        return local if local is not None and local.serving else None

    def load(self) -> None:
        """Read the store now (blocking): at start-up, before serving; StoreUnavailable when
        a PostgreSQL store cannot be reached (and no local snapshot can stand in for it) or
        is not migrated."""
        if self.spec.kind == "postgresql":
            from zerohop.gateway.store.key_snapshot import read_or_load
            from zerohop.gateway.store.pg_key_feed import read_now

            self._apply_index(read_or_load(lambda: read_now(self.spec.url), self.local_copy))
            return
        if self.repository.version() == self._keys.version:
            return
        version, index = self.repository.snapshot()
        self.apply(version, index, self.repository.has_keys())

    def apply_rows(self, rows: KeyRows) -> None:
        """Serve `rows`, just read from the store, and keep them as the local snapshot (the
        key feed's thread)."""
        read_at = time.time()
        self._apply_index(rows)
        if self.local_copy is not None:
            self.local_copy.save(rows, read_at)

    def _apply_index(self, rows: KeyRows) -> None:
        self.apply(rows.version, rows.index(), rows.has_keys)

    def apply(self, version: int, index: dict[str, KeyEntry], has_keys: bool) -> None:
        """Serve `index` from now on (from any thread: requests see the old or the new one)."""
        by_id = {entry.key_id: entry for entry in index.values()}
        self._keys = _Keys(version, index, by_id, has_keys)
        invalid = [entry for entry in index.values() if isinstance(entry, InvalidKey)]
        revoked = sum(isinstance(entry, RevokedKey) for entry in index.values())
        for entry in invalid:
            log.error(
                "keys: key %s is refused (403) until its configuration is fixed: %s",
                entry.key_id,
                "; ".join(entry.problems),
            )
        log.info(
            "keys: %d active keys loaded, %d of them invalid (store version %d)",
            len(index) - revoked,
            len(invalid),
            version,
        )

    def start_watching(self) -> None:
        if self.spec.kind == "postgresql":
            from zerohop.gateway.store.pg_key_feed import KeyFeed

            self.feed = KeyFeed(
                self.spec.url,
                lambda: self._keys.version,
                self.apply_rows,
                full_first=self.snapshot_served is not None,  # whatever the version says
            )
            self.feed.start()
        else:
            self._task = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Stop following the store (blocking); the store is its owner's to close."""
        if self.feed is not None:
            self.feed.stop()
            self.feed = None

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(RELOAD_INTERVAL)
            try:
                await asyncio.to_thread(self.load)
            except Exception:  # a locked or damaged store: keep serving the last good index
                log.exception("keys: reloading %s failed", self.describe())

    def identity_for(self, key_id: str) -> Identity | None:
        """The identity of a stored key by its public id, as the current snapshot has it:
        None once it is revoked, expired or invalid (a batch's later lines run as it is now)."""
        if key_id == ANONYMOUS.key_id and not self.keys_configured:
            return ANONYMOUS
        entry = self._keys.by_id.get(key_id)
        if not isinstance(entry, Identity):
            return None
        expires = entry.expires_at
        return entry if expires is None or time.time() < expires else None

    def known_key(self, key_id: str) -> KeyRef | None:
        """A stored key by its public id, revoked and invalid ones too (the audit's name for
        a console session's key); None if the store has no such key."""
        entry = self._keys.by_id.get(key_id)
        return None if entry is None else entry.ref()

    def authenticate(self, token: str | None) -> Identity:
        if not self.keys_configured:
            return ANONYMOUS
        if not token:
            raise AuthenticationError(
                "missing API key: send it in the x-api-key header or as Authorization: Bearer"
            )
        if self.verifier is not None and not token.startswith("zh-"):
            try:
                return self.verifier.verify(token)
            except AuthenticationError:
                raise
            except Exception as exc:  # the verifier's own error type: same meaning
                raise AuthenticationError(str(exc), getattr(exc, "key", None)) from exc
        identity = self._keys.index.get(hash_secret(token))
        if identity is None:
            raise AuthenticationError(UNKNOWN_KEY)
        if isinstance(identity, RevokedKey):  # told apart from an unknown key in the audit only
            raise AuthenticationError(UNKNOWN_KEY, identity.ref())
        if isinstance(identity, InvalidKey):
            raise InvalidKeyConfiguration(
                f"API key {identity.key_id} cannot be used: this key's configuration is"
                f" invalid ({', '.join(identity.fields)}); the server's log says why",
                identity.ref(),
            )
        if identity.expires_at is not None and time.time() >= identity.expires_at:
            raise AuthenticationError(f"API key {identity.key_id} has expired", identity.ref())
        return identity


def check_model(identity: Identity, model: str) -> None:
    if not identity.allows_model(model):
        raise PermissionDenied(f"API key {identity.key_id} may not use model '{model}'")
