"""What the admin API and the console share: who the operator is, and the parts they read.

`AdminContext.admin_identity` turns a key (a header, or the key typed on the console's login
page) into an admin's Identity or an `AdminError`; `session_identity` does the same for a
console session, so a session dies as soon as its key stops being an admin key (its caller
ends the session in the store on that error).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zerohop.admin.errors import AdminError as AdminError  # re-exported
from zerohop.admin.errors import checked as checked
from zerohop.admin.errors import invalid as invalid
from zerohop.admin.errors import not_found as not_found
from zerohop.admin.sessions import Session, SessionStore
from zerohop.gateway.auth import AuthenticationError, InvalidKeyConfiguration
from zerohop.gateway.keys.identity import Identity, KeyRef

if TYPE_CHECKING:
    from zerohop.admin.service import AdminService
    from zerohop.batches.store import AnyBatchStore
    from zerohop.gateway.gateway import Gateway


@dataclass(slots=True)
class AdminRequest:
    """One admin API request, as the route's view reads it."""

    method: str
    identity: Identity
    query: dict[str, list[str]]
    params: dict[str, str] = field(default_factory=dict)
    body: Any = None  # the JSON object sent (methods with a body)


@dataclass(slots=True)
class AdminContext:
    gateway: Gateway
    service: AdminService | None = None  # the admin API's (attach_operator gives it)
    sessions: SessionStore = field(default_factory=SessionStore)
    secure_cookies: bool = False  # --secure-cookies: Secure even on a plain-HTTP request
    batches: AnyBatchStore | None = None  # where batches are served

    def admin_identity(self, token: str | None) -> Identity:
        """The admin key `token` is, or AdminError: 401 no key or an unknown one, 403 a key
        that is not an admin key."""
        if not token:
            raise AdminError(
                401, "authentication_error", "this route needs an admin key",
                reason="authentication",
            )  # fmt: skip
        if not self.gateway.auth.keys_configured:
            raise AdminError(
                401, "authentication_error",
                "no admin key exists on this server: make one with"
                " `zerohop keys create --tenant ops --admin`",
                reason="authentication",
            )  # fmt: skip
        try:
            identity = self.gateway.auth.authenticate(token)
        except (AuthenticationError, InvalidKeyConfiguration) as exc:
            raise AdminError(
                401, "authentication_error", str(exc), reason="authentication", key=exc.key
            ) from exc
        return self._admin(identity)

    def session_identity(self, session: Session) -> Identity:
        """The admin behind a console session, as the store has that key now."""
        identity = self.gateway.auth.identity_for(session.key_id)
        if identity is None:
            raise AdminError(
                401, "authentication_error", "the session's admin key is gone",
                reason="authentication", key=self.session_key(session),
            )  # fmt: skip
        return self._admin(identity)

    def session_key(self, session: Session) -> KeyRef:
        """The key a session logged in with, as the audit names it (revoked ones too)."""
        return self.gateway.auth.known_key(session.key_id) or KeyRef(session.key_id)

    @staticmethod
    def _admin(identity: Identity) -> Identity:
        if not identity.admin:
            raise AdminError(
                403, "permission_error",
                f"API key {identity.key_id} is not an admin key: admin routes need one"
                " (`zerohop keys create --admin`)",
                reason="permission", key=identity.ref(),
            )  # fmt: skip
        return identity
