"""Whether a browser says another site's page made a request (the admin API's and the
console's check, beside the session's CSRF token)."""

from __future__ import annotations

from zerohop.api.http.asgi import Scope, header

DEFAULT_PORTS = {"http": 80, "https": 443}


def _host(scope: Scope) -> str | None:
    """The Host header the browser sent, as `name[:port]` without the default port."""
    host = header(scope, b"host")
    if host is None:
        return None
    return _normal_host(host.decode("latin-1").strip().lower(), scope.get("scheme", "http"))


def _normal_host(host: str, scheme: str) -> str:
    """`host[:port]` without the scheme's default port (browsers omit it from Origin)."""
    name, sep, port = host.rpartition(":")
    if sep and port.isdigit() and int(port) == DEFAULT_PORTS.get(scheme):
        return name
    return host


def cross_site(scope: Scope) -> bool:
    """The browser says another site's page made this request.

    `Sec-Fetch-Site` decides where it is sent (every current browser): only `same-origin`
    and `none` (typed by the user) pass. Otherwise an `Origin` naming another host refuses
    it (only host and port are compared, so TLS ended at a proxy in front still matches),
    and so does an opaque one ("null"). A browser sends "null" for a same-origin POST under
    this console's `Referrer-Policy: no-referrer`, which is why Sec-Fetch-Site comes first.
    A request with neither header (curl, a script) is no browser's cross-site request."""
    fetch_site = header(scope, b"sec-fetch-site")
    if fetch_site is not None:
        return fetch_site.strip().lower() not in (b"same-origin", b"none")
    origin = header(scope, b"origin")
    if origin is None:
        return False
    scheme, sep, rest = origin.decode("latin-1").strip().lower().partition("://")
    if not sep:  # "null": a sandboxed frame, a data: URL, a redirect across origins
        return True
    ours = _host(scope)
    return ours is None or _normal_host(rest.rstrip("/"), scheme) != ours
