"""Authentication: the key a request carries, looked up in memory, or a signed token.

The store's keys are held in a dict from secret hash to Identity, swapped whole when the
store changes (polled every half second off the event loop), so a lookup takes no lock and
touches no disk. With no key in the store and no signing key configured, every caller is
anonymous (the server only allows that on loopback, or with --allow-anonymous).

A key whose row in the store (or whose tenant's row) holds an invalid value, written by an
older version or by hand, is not served and does not stop the others: each load logs the
row and field once, and a request with that key gets 403 "this key's configuration is
invalid" naming the fields (`InvalidKeyConfiguration`), until the operator fixes the row
with `zerohop keys update` or `zerohop keys tenant`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from zerohop.gateway.identity import ANONYMOUS, Identity
from zerohop.gateway.store import KeyStore, hash_secret
from zerohop.gateway.store_rows import InvalidKey

log = logging.getLogger(__name__)
RELOAD_INTERVAL = 0.5  # seconds: store changes are live within a second


class AuthenticationError(Exception):
    """No key, an unknown key, a revoked or an expired one (401)."""


class PermissionDenied(Exception):
    """A valid key that may not use this model (403)."""


class InvalidKeyConfiguration(PermissionDenied):
    """A known key whose stored configuration is invalid (403; the log names the row)."""


class Authenticator:
    def __init__(self, store_path: Path, verifier: Any | None = None) -> None:
        self.store_path = store_path
        self.verifier = verifier  # a signed_keys.SignedKeyVerifier, or None
        self._index: dict[str, Identity | InvalidKey] = {}
        self._has_keys = False
        self._version = -1
        self._store: KeyStore | None = None
        self._task: asyncio.Task | None = None

    @property
    def keys_configured(self) -> bool:
        return self._has_keys or self.verifier is not None

    def load(self) -> None:
        """Read the store now (blocking): at start-up, before serving."""
        if self._store is None:
            self._store = KeyStore(self.store_path)
        if self._store.version() == self._version:
            return
        version, index = self._store.snapshot()
        has_keys = self._store.has_keys()
        self._index, self._has_keys, self._version = index, has_keys, version
        invalid = [entry for entry in index.values() if isinstance(entry, InvalidKey)]
        for entry in invalid:
            log.error(
                "keys: key %s is refused (403) until its configuration is fixed: %s",
                entry.key_id,
                "; ".join(entry.problems),
            )
        log.info(
            "keys: %d active keys loaded, %d of them invalid (store version %d)",
            len(index),
            len(invalid),
            version,
        )

    def start_watching(self) -> None:
        self._task = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._store is not None:
            self._store.close()
            self._store = None

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(RELOAD_INTERVAL)
            try:
                await asyncio.to_thread(self.load)
            except Exception:  # a locked or damaged store: keep serving the last good index
                log.exception("keys: reloading %s failed", self.store_path)

    def identity_for(self, key_id: str) -> Identity | None:
        """The identity of a stored key by its public id, as the current snapshot has it:
        None once it is revoked, expired or invalid (a batch's later lines run as it is now)."""
        if key_id == ANONYMOUS.key_id and not self.keys_configured:
            return ANONYMOUS
        for entry in self._index.values():
            if entry.key_id == key_id:
                if isinstance(entry, InvalidKey):
                    return None
                expires = entry.expires_at
                return entry if expires is None or time.time() < expires else None
        return None

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
                raise AuthenticationError(str(exc)) from exc
        identity = self._index.get(hash_secret(token))
        if identity is None:
            raise AuthenticationError("invalid API key (unknown or revoked)")
        if isinstance(identity, InvalidKey):
            raise InvalidKeyConfiguration(
                f"API key {identity.key_id} cannot be used: this key's configuration is"
                f" invalid ({', '.join(identity.fields)}); the server's log says why"
            )
        if identity.expires_at is not None and time.time() >= identity.expires_at:
            raise AuthenticationError(f"API key {identity.key_id} has expired")
        return identity


def check_model(identity: Identity, model: str) -> None:
    if not identity.allows_model(model):
        raise PermissionDenied(f"API key {identity.key_id} may not use model '{model}'")
