"""The console's response headers and its checks on where a request came from.

Every console response carries a strict Content-Security-Policy (scripts, styles and fetches
from this origin only; no inline script or style, no frames, no <base>), and the headers
that stop sniffing, framing and referrers. A request that changes something is refused
when the browser says it came from another site (`Sec-Fetch-Site`, or `Origin` where a
browser sends no Sec-Fetch-Site); the session's CSRF token is checked on top of that
(routes.py).
"""

from __future__ import annotations

from zerohop.admin.origin import cross_site as cross_site  # re-exported: routes.py's check
from zerohop.api.http.asgi import Headers

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:;"
    " connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)

SECURITY_HEADERS: Headers = [
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"cross-origin-opener-policy", b"same-origin"),
]
PAGE_HEADERS: Headers = [
    (b"content-type", b"text/html; charset=utf-8"),
    (b"cache-control", b"no-store"),
    *SECURITY_HEADERS,
]
