"""The console's HTML: Jinja2 shells (autoescaped) that console.js fills from the admin API.

A page is a base layout (the navigation, the admin key in use, a logout form, the CSRF
token in `<meta name="csrf-token">`) around one page's skeleton: its tables, forms and
chart boxes with stable ids. No page holds an inline script or style.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jinja2

from zerohop.console.assets import asset_url

TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"


@dataclass(slots=True, frozen=True)
class Page:
    name: str  # the path segment under /console/ and the template's stem
    title: str
    charts: bool = False  # loads uPlot


PAGES: dict[str, Page] = {
    page.name: page
    for page in (
        Page("overview", "Overview", charts=True),
        Page("tenants", "Tenants and keys"),
        Page("usage", "Usage", charts=True),
        Page("refusals", "Refusals"),
        Page("audit", "Audit"),
    )
}

_env = jinja2.Environment(
    loader=jinja2.FileSystemLoader(TEMPLATES_DIR),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
_env.globals["asset_url"] = asset_url
_env.globals["pages"] = list(PAGES.values())


@dataclass(slots=True, frozen=True)
class Viewer:
    """Who is logged in, as the layout shows it."""

    key_id: str
    tenant: str
    name: str
    csrf_token: str


def render_page(page: Page, viewer: Viewer) -> bytes:
    template = _env.get_template(f"{page.name}.html")
    return template.render(page=page, viewer=viewer).encode()


def render_login(error: str | None = None) -> bytes:
    return _env.get_template("login.html").render(error=error).encode()


def render_error(status: int, message: str) -> bytes:
    return _env.get_template("error.html").render(status=status, message=message).encode()
