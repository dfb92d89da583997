"""What the admin API and the console share: who the operator is, and the parts they read.

`AdminContext.admin_identity` turns a key (a header, or the key typed on the console's login
page) into an admin's Identity or an `AdminError`; `session_identity` does the same for a
console session, so a session dies as soon as its key stops being an admin key (its caller
ends the session in the store on that error).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from zerohop.admin.sessions import Session, SessionStore
from zerohop.gateway.auth import AuthenticationError, InvalidKeyConfiguration
from zerohop.gateway.keys.identity import Identity, KeyRef

if TYPE_CHECKING:
    from zerohop.batches.store import AnyBatchStore
    from zerohop.gateway.gateway import Gateway

T = TypeVar("T")


class AdminError(Exception):
    """An admin request refused: HTTP `status`, Anthropic's error `type`, a message. One
    refused for who sent it has a `reason` and the `key` presented, when known: it is
    audited (`zerohop.admin.refusal_audit`)."""

    def __init__(
        self, status: int, kind: str, message: str, *, reason: str | None = None,
        key: KeyRef | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message
        self.reason, self.key = reason, key


def not_found(message: str) -> AdminError:
    return AdminError(404, "not_found_error", message)


def invalid(message: str) -> AdminError:
    return AdminError(400, "invalid_request_error", message)


def checked(check: Callable[..., T], *args: Any) -> T:
    """`check(*args)`, its ValueError (a value the caller sent) answered as a 400."""
    try:
        return check(*args)
    except ValueError as exc:
        raise invalid(str(exc)) from None


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
    service: Any = None  # zerohop.admin.service.AdminService
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
