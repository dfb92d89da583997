"""The console's routes: every path under /console (mounted by zerohop.app.routes).

- `GET /console`: 303 to the overview;
- `GET /console/login`: the login form; `POST /console/login` (form field `key`): an admin
  key starts a session (an HttpOnly, SameSite=Strict cookie) and 303s to the overview, any
  other key gets the form again with the reason (401 or 403);
- `POST /console/logout`: needs the session's CSRF token (form field `csrf` or header
  `x-csrf-token`);
- `GET /console/{overview,tenants,usage,refusals,audit}`: the pages, for a live session of a
  key that is still an admin key (otherwise 303 to the login form);
- `GET /console/static/<name>`: the package's static files (assets.py).

A request that changes something is refused when it comes from another site (security.py).
Every response carries the console's security headers. A refused login, CSRF token,
cross-site request or dead session is audited (`zerohop.admin.refusal_audit`).
"""

from __future__ import annotations

from urllib.parse import parse_qs

from zerohop.admin.context import AdminContext, AdminError
from zerohop.admin.refusal_audit import audit_error, audit_refusal
from zerohop.admin.sessions import (
    Session,
    SessionsUnavailable,
    cookie_header,
    secure_cookie,
    session_cookie,
)
from zerohop.api.errors import ApiError
from zerohop.api.http.asgi import (
    ClientDisconnected,
    Headers,
    Receive,
    Scope,
    Send,
    header,
    read_body,
)
from zerohop.console.assets import MAX_AGE, asset_for
from zerohop.console.pages import PAGES, Viewer, render_error, render_login, render_page
from zerohop.console.security import PAGE_HEADERS, SECURITY_HEADERS, cross_site

LOGIN, OVERVIEW = "/console/login", "/console/overview"
MAX_FORM_BYTES = 16 * 1024
FORM_TYPE = b"application/x-www-form-urlencoded"
READS = ("GET", "HEAD")
STATIC_CACHE = f"public, max-age={MAX_AGE}".encode()


async def handle(scope: Scope, receive: Receive, send: Send, admin: AdminContext) -> None:
    try:
        await _route(scope, receive, send, admin)
    except SessionsUnavailable:  # raised before anything is sent
        message = "The console's sessions cannot be reached now; try again shortly."
        await _error(send, 503, message, scope["method"] == "HEAD")


async def _route(scope: Scope, receive: Receive, send: Send, admin: AdminContext) -> None:
    path, method = scope["path"], scope["method"]
    head = method == "HEAD"
    if path in ("/console", "/console/"):
        if method not in READS:
            return await _not_allowed(send, "GET, HEAD", head)
        return await _redirect(send, OVERVIEW)
    if path.startswith("/console/static/"):
        return await _static(send, path, method)
    if path == LOGIN:
        if method in READS:
            return await _login_form(scope, send, admin, head)
        if method == "POST":
            return await _login(scope, receive, send, admin)
        return await _not_allowed(send, "GET, HEAD, POST", head)
    if path == "/console/logout":
        if method != "POST":
            return await _not_allowed(send, "POST", head)
        return await _logout(scope, receive, send, admin)
    page = PAGES.get(path.removeprefix("/console/"))
    if page is None:
        return await _error(send, 404, "There is no such console page.", head)
    if method not in READS:
        return await _not_allowed(send, "GET, HEAD", head)
    session = await admin.sessions.get(session_cookie(scope["headers"]))
    if session is None:
        if session_cookie(scope["headers"]) is not None:  # expired, logged out or unknown
            audit_refusal(admin, scope, "console", 303, "session")
        return await _to_login(scope, send, admin)
    try:
        identity = admin.session_identity(session)
    except AdminError as exc:  # revoked, expired, no longer an admin key: the session is over
        await admin.sessions.end(session.session_id)
        audit_error(admin, scope, "console", exc, status=303)
        return await _to_login(scope, send, admin)
    viewer = Viewer(identity.key_id, identity.tenant.name, identity.name, session.csrf_token)
    await _html(send, 200, render_page(page, viewer), head=head)


# -- login and logout ---------------------------------------------------------------------------


async def _login_form(scope: Scope, send: Send, admin: AdminContext, head: bool) -> None:
    session = await admin.sessions.get(session_cookie(scope["headers"]))
    if session is not None and await _still_admin(admin, session):
        return await _redirect(send, OVERVIEW)
    await _html(send, 200, render_login(), head=head)


async def _login(scope: Scope, receive: Receive, send: Send, admin: AdminContext) -> None:
    if cross_site(scope):
        audit_refusal(admin, scope, "console", 403, "cross_site")
        return await _html(send, 403, render_login("A login from another site is refused."))
    try:
        form = await _read_form(scope, receive)
    except ClientDisconnected:
        return
    except ApiError as exc:
        return await _html(send, exc.status, render_login(exc.message))
    try:
        identity = admin.admin_identity(form.get("key", "").strip())
    except AdminError as exc:
        audit_error(admin, scope, "console", exc)
        return await _html(send, exc.status, render_login(exc.message))
    if identity.source != "store":  # a session re-reads its key from the store each time
        audit_refusal(admin, scope, "console", 403, "permission", identity.ref())
        message = "A signed key cannot open a console session: use a stored admin key."
        return await _html(send, 403, render_login(message))
    await admin.sessions.end(session_cookie(scope["headers"]))  # a previous session, if any
    session = await admin.sessions.create(identity.key_id)
    if admin.service is not None:
        admin.service.audit(identity, "console.login", identity.key_id, None, None)
    secure = secure_cookie(scope, admin.secure_cookies)
    cookie = cookie_header(session, secure, admin.sessions.lifetime)
    await _redirect(send, OVERVIEW, [cookie])


async def _logout(scope: Scope, receive: Receive, send: Send, admin: AdminContext) -> None:
    if cross_site(scope):
        audit_refusal(admin, scope, "console", 403, "cross_site")
        return await _error(send, 403, "A request from another site is refused.")
    session = await admin.sessions.get(session_cookie(scope["headers"]))
    token = header(scope, b"x-csrf-token")
    try:
        form = await _read_form(scope, receive, required=False)
    except ClientDisconnected:
        return
    except ApiError as exc:
        return await _error(send, exc.status, exc.message)
    if session is None:  # nothing to end
        return await _to_login(scope, send, admin)
    csrf = token.decode("latin-1") if token is not None else form.get("csrf")
    if not session.csrf_matches(csrf):
        audit_refusal(admin, scope, "console", 403, "csrf", admin.session_key(session))
        return await _error(send, 403, "This request lacks the session's CSRF token.")
    await admin.sessions.end(session.session_id)
    clear = cookie_header(None, secure_cookie(scope, admin.secure_cookies), 0)
    await _redirect(send, LOGIN, [clear])


async def _still_admin(admin: AdminContext, session: Session) -> bool:
    try:
        admin.session_identity(session)
    except AdminError:
        await admin.sessions.end(session.session_id)
        return False
    return True


async def _read_form(scope: Scope, receive: Receive, required: bool = True) -> dict[str, str]:
    """The fields of a form-urlencoded body (the first value of each); for another content
    type ApiError 415 where the form is `required`, else {}; 413 past MAX_FORM_BYTES."""
    content_type = (header(scope, b"content-type") or b"").split(b";")[0].strip().lower()
    if content_type != FORM_TYPE:
        if required:
            raise ApiError(415, "This form must be sent as application/x-www-form-urlencoded.")
        await read_body(receive, MAX_FORM_BYTES)
        return {}
    body = await read_body(receive, MAX_FORM_BYTES)
    fields = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
    return {name: values[0] for name, values in fields.items()}


# -- responses ----------------------------------------------------------------------------------


async def _respond(send: Send, status: int, headers: Headers, body: bytes, head: bool) -> None:
    length = (b"content-length", str(len(body)).encode())
    await send({"type": "http.response.start", "status": status, "headers": [*headers, length]})
    await send({"type": "http.response.body", "body": b"" if head else body})


async def _html(
    send: Send, status: int, body: bytes, extra: Headers = (), head: bool = False
) -> None:
    await _respond(send, status, [*PAGE_HEADERS, *extra], body, head)


async def _error(send: Send, status: int, message: str, head: bool = False) -> None:
    await _html(send, status, render_error(status, message), head=head)


async def _not_allowed(send: Send, allow: str, head: bool) -> None:
    allowed = [(b"allow", allow.encode())]
    await _html(send, 405, render_error(405, "This method is not allowed here."), allowed, head)


async def _redirect(send: Send, location: str, extra: Headers = ()) -> None:
    headers = [
        (b"location", location.encode()),
        (b"cache-control", b"no-store"),
        *SECURITY_HEADERS,
        *extra,
    ]
    await _respond(send, 303, headers, b"", head=True)


async def _to_login(scope: Scope, send: Send, admin: AdminContext) -> None:
    """303 to the login form; a stale session cookie the browser sent is cleared."""
    stale = session_cookie(scope["headers"]) is not None
    clear = cookie_header(None, secure_cookie(scope, admin.secure_cookies), 0)
    await _redirect(send, LOGIN, [clear] if stale else [])


async def _static(send: Send, path: str, method: str) -> None:
    if method not in READS:
        return await _not_allowed(send, "GET, HEAD", method == "HEAD")
    asset = asset_for(path)
    if asset is None:
        return await _error(send, 404, "There is no such file.", method == "HEAD")
    headers = [
        (b"content-type", asset.content_type),
        (b"cache-control", STATIC_CACHE),
        *SECURITY_HEADERS,
    ]
    await _respond(send, 200, headers, asset.body, method == "HEAD")
