"""The audit record of an admin-API or console request refused for who sent it.

A missing or bad key (unknown, revoked, expired), a key that is not an admin key, a missing
or wrong CSRF token, a request the browser marks as another site's, and a session cookie that
opens no live session are each written to the audit log as a request record (no `"kind"`),
shaped as the data plane's (`zerohop.gateway.gateway.audit_entry`), so the audit search finds
them by key, tenant, status and time:

    key_id, tenant   the key presented, when the store knows it (revoked ones too), or the
                     console session's key; else "anonymous"
    surface          "admin" (the admin API) or "console"
    method, path     the request's
    client           the peer's host:port
    status           the status answered (a console page answers a dead session with 303)
    decision         the reason, also in `error_type`: one of REASONS

Never a secret, a cookie or a CSRF token. A request refused for what it asks (a bad body, an
unknown route) is not such a refusal and gets no record: that is the handler's 4xx.
"""

from __future__ import annotations

import time
from typing import Any

from zerohop.admin.context import AdminContext, AdminError
from zerohop.api.http.asgi import Scope, client_address
from zerohop.api.serving.service import new_request_id
from zerohop.gateway.keys.identity import ANONYMOUS, KeyRef

REASONS = {
    "authentication": "no key, an unknown, revoked or expired one, or the session's key gone",
    "permission": "a key that is not an admin key (or, at the console, a signed one)",
    "csrf": "a session's request that changes something without its CSRF token",
    "cross_site": "a request the browser says another site's page made",
    "session": "a session cookie that opens no live session (expired, logged out, unknown)",
}


def audit_refusal(
    admin: AdminContext, scope: Scope, surface: str, status: int, reason: str,
    key: KeyRef | None = None,
) -> None:  # fmt: skip
    """Record one refused request (never blocks: the audit log's writer does the I/O)."""
    assert reason in REASONS, reason
    audit = admin.gateway.audit
    if audit is None:
        return
    who = key or ANONYMOUS.ref()
    entry: dict[str, Any] = {
        "time": time.time(),
        "request_id": new_request_id(),
        "key_id": who.key_id,
        "tenant": who.tenant,
        "surface": surface,
        "method": scope["method"],
        "path": scope["path"],
        "http_version": scope.get("http_version"),
        "client": client_address(scope),
        "status": status,
        "error_type": reason,
        "decision": reason,
    }
    audit.record(entry)


def audit_error(
    admin: AdminContext, scope: Scope, surface: str, error: AdminError, status: int | None = None
) -> None:
    """Record `error` if it refuses who sent the request (it has a reason); `status`: the
    one answered, where it is not the error's (a console page's 303 to the login form)."""
    if error.reason is not None:
        audit_refusal(admin, scope, surface, status or error.status, error.reason, error.key)
