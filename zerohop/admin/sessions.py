"""The console's login sessions: a random id in an HttpOnly cookie, its CSRF token beside it.

Held in this process's memory (a replica's console is reached on that replica), so a
restart logs everyone out. A session ends after `idle` seconds without a request, after
`lifetime` seconds in all, on logout, and as soon as its admin key stops being an admin key
(revoked, expired, changed): the admin API checks the key on every request.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

COOKIE = "zerohop_console"
MAX_SESSIONS = 10_000  # a flood of logins evicts the oldest, never grows memory


@dataclass(slots=True)
class Session:
    session_id: str
    key_id: str  # the admin key that logged in
    csrf_token: str
    created: float
    last_seen: float

    def csrf_matches(self, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(token.encode(), self.csrf_token.encode())


class SessionStore:
    def __init__(
        self,
        idle: float = 3600.0,
        lifetime: float = 12 * 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.idle, self.lifetime, self.clock = idle, lifetime, clock
        self._sessions: dict[str, Session] = {}

    def create(self, key_id: str) -> Session:
        now = self.clock()
        if len(self._sessions) >= MAX_SESSIONS:
            oldest = min(self._sessions.values(), key=lambda s: s.last_seen)
            del self._sessions[oldest.session_id]
        session = Session(secrets.token_urlsafe(32), key_id, secrets.token_urlsafe(32), now, now)
        self._sessions[session.session_id] = session
        return session

    def get(self, session_id: str | None) -> Session | None:
        """The live session of that id (touched), or None."""
        session = self._sessions.get(session_id or "")
        if session is None:
            return None
        now = self.clock()
        if now - session.last_seen > self.idle or now - session.created > self.lifetime:
            del self._sessions[session.session_id]
            return None
        session.last_seen = now
        return session

    def end(self, session_id: str | None) -> None:
        self._sessions.pop(session_id or "", None)

    def __len__(self) -> int:
        return len(self._sessions)


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
    """Set-Cookie for `session` (None: clear it): HttpOnly, SameSite=Strict, Path=/."""
    value = session.session_id if session is not None else ""
    age = int(max_age) if session is not None else 0
    flags = "; Secure" if secure else ""
    cookie = f"{COOKIE}={value}; Path=/; HttpOnly; SameSite=Strict; Max-Age={age}{flags}"
    return (b"set-cookie", cookie.encode())
