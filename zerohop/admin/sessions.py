"""The console's login sessions: a random id in an HttpOnly cookie, its CSRF token beside it.

Sessions live in the key store (`zerohop.gateway.store.session_tables`: the SQLite keys.db,
or the fleet's PostgreSQL with `--store`), so every replica sharing that store serves a
session and a restart keeps it. The store holds the SHA-256 of the id, never the id; the
CSRF token is derived from the id (an HMAC under it), so the store holds no token either.

A session ends after `idle` seconds without a request, after `lifetime` seconds in all, on
logout (on every replica at once: the row is marked revoked), and as soon as its admin key
stops being an admin key (revoked, expired, changed): the admin routes and the console check
the key on every request. Each request reads the row; `last_seen` is written at most once
every `touch_every` seconds (60 by default), not on every request, so the idle timeout may
end a session up to that much early. The store's session repository is called from a
worker thread (`asyncio.to_thread`): the event loop never waits on a disk or the database.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from zerohop.gateway.store.repositories import SessionRepository
from zerohop.gateway.store.session_tables import SessionCaps, SessionRow
from zerohop.gateway.store.spec import StoreUnavailable
from zerohop.gateway.store.store import Store

log = logging.getLogger(__name__)

COOKIE = "zerohop_console"
MAX_SESSIONS = 10_000  # rows in the store at most: a flood of logins evicts the oldest
MAX_SESSIONS_PER_KEY = 64  # an admin key's sessions at most (its oldest go first)
TOUCH_EVERY = 60.0  # seconds between writes of a session's last_seen
MAX_ID_CHARS = 64  # a longer cookie value is no session id of ours: not looked up
_CSRF_LABEL = b"zerohop console csrf"
T = TypeVar("T")


class SessionsUnavailable(Exception):
    """The key store that holds the sessions cannot be reached now."""


@dataclass(slots=True)
class Session:
    session_id: str
    key_id: str  # the admin key that logged in
    csrf_token: str
    created: float
    last_seen: float

    def csrf_matches(self, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(token.encode(), self.csrf_token.encode())


def session_digest(session_id: str) -> str:
    """What the store keys a session by: the SHA-256 of its id."""
    return hashlib.sha256(session_id.encode()).hexdigest()


def csrf_token_for(session_id: str) -> str:
    """The session's CSRF token: an HMAC under the id, so only the id's holder can make it."""
    return hmac.new(session_id.encode(), _CSRF_LABEL, hashlib.sha256).hexdigest()


class SessionStore:
    """Console sessions in a store's session repository (by default, a store of this
    process's own: no gateway to share one with)."""

    def __init__(
        self,
        repository: SessionRepository | None = None,
        idle: float = 3600.0,
        lifetime: float = 12 * 3600.0,
        touch_every: float = TOUCH_EVERY,
        clock: Callable[[], float] = time.time,  # shared between replicas: wall-clock time
    ) -> None:
        self.repository = repository if repository is not None else Store.in_memory().sessions
        self.idle, self.lifetime, self.touch_every, self.clock = idle, lifetime, touch_every, clock

    async def create(self, key_id: str) -> Session:
        session_id = secrets.token_urlsafe(32)
        now = self.clock()
        row = SessionRow(session_digest(session_id), key_id, now, now, now + self.lifetime)
        caps = SessionCaps(self.idle, MAX_SESSIONS_PER_KEY, MAX_SESSIONS)
        await self._run(lambda: self.repository.create(row, caps))
        return Session(session_id, key_id, csrf_token_for(session_id), now, now)

    async def get(self, session_id: str | None) -> Session | None:
        """The live session of that id (its last_seen written if due), or None."""
        if not session_id or len(session_id) > MAX_ID_CHARS:
            return None
        return await self._run(lambda: self._live(session_id))

    async def end(self, session_id: str | None) -> None:
        """Log the session out, on every replica (nothing for no id, or an unknown one)."""
        if not session_id or len(session_id) > MAX_ID_CHARS:
            return
        digest = session_digest(session_id)
        await self._run(lambda: self.repository.end(digest, self.clock()))

    def _live(self, session_id: str) -> Session | None:
        digest, now = session_digest(session_id), self.clock()
        row = self.repository.get(digest, now, self.idle)
        if row is None:
            return None
        last_seen = row.last_seen
        if now - last_seen >= self.touch_every:
            self.repository.touch(digest, now, self.touch_every)
            last_seen = now
        return Session(session_id, row.key_id, csrf_token_for(session_id), row.created, last_seen)

    async def _run(self, work: Callable[[], T]) -> T:
        try:
            return await asyncio.to_thread(work)
        except StoreUnavailable as exc:
            log.warning("console sessions: %s", exc)
            raise SessionsUnavailable(str(exc)) from exc


def session_cookie(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The console session id from an ASGI request's Cookie header(s), or None."""
    for name, value in headers:
        if name != b"cookie":
            continue
        for part in value.decode("latin-1").split(";"):
            key, _, val = part.strip().partition("=")
            if key == COOKIE and val:
                return val
    return None


def cookie_header(session: Session | None, secure: bool, max_age: float) -> tuple[bytes, bytes]:
    """Set-Cookie for `session` (None: clear it): HttpOnly, SameSite=Strict, Path=/; Secure
    where `secure` (see `secure_cookie`)."""
    value = session.session_id if session is not None else ""
    age = int(max_age) if session is not None else 0
    flags = "; Secure" if secure else ""
    cookie = f"{COOKIE}={value}; Path=/; HttpOnly; SameSite=Strict; Max-Age={age}{flags}"
    return (b"set-cookie", cookie.encode())


def secure_cookie(scope: dict[str, Any], always: bool) -> bool:
    """Whether the session cookie of this request's answer is Secure: `always` (the
    operator's --secure-cookies), or the request came over HTTPS: served with --tls-cert, or
    through a TLS-terminating proxy whose `X-Forwarded-Proto: https` the server trusts
    (uvicorn's proxy-headers middleware rewrites `scheme` for --forwarded-allow-ips only)."""
    return always or scope.get("scheme") == "https"
