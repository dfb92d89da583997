"""The console's static files: the package's own, read once at import, served by name.

The allow-list is the listing of `static/` (its *.js and *.css) and of each
`static/vendor/<library>/` taken at import: a request names one of those files or gets a
404, so no path from a request ever reaches the file system (no traversal). Each file's URL
carries a digest of its content (`?v=...`), so a page never runs an old script after an
upgrade even though the files are cached for an hour.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

STATIC_DIR = Path(__file__).resolve().parent / "static"
PREFIX = "/console/static/"
MAX_AGE = 3600
CONTENT_TYPES = {
    ".js": b"text/javascript; charset=utf-8",
    ".css": b"text/css; charset=utf-8",
    ".map": b"application/json",
    ".svg": b"image/svg+xml",
    ".png": b"image/png",
    ".ico": b"image/x-icon",
}
TEXT = b"text/plain; charset=utf-8"  # LICENSE, VERSION


@dataclass(slots=True, frozen=True)
class Asset:
    name: str  # its path under /console/static/, e.g. "vendor/uplot/uPlot.min.css"
    body: bytes
    content_type: bytes
    digest: str  # 12 hex digits of its SHA-256

    @property
    def url(self) -> str:
        return f"{PREFIX}{self.name}?v={self.digest}"


def _asset(name: str, path: Path) -> Asset:
    body = path.read_bytes()
    content_type = CONTENT_TYPES.get(path.suffix.lower(), TEXT)
    return Asset(name, body, content_type, hashlib.sha256(body).hexdigest()[:12])


def load_assets(root: Path = STATIC_DIR) -> dict[str, Asset]:
    """Every servable file under `root`, by its name under /console/static/."""
    found: dict[str, Asset] = {}
    if root.is_dir():
        for path in sorted(root.iterdir()):
            if path.is_file() and path.suffix in (".js", ".css"):
                found[path.name] = _asset(path.name, path)
        vendor = root / "vendor"
        for library in sorted(vendor.iterdir()) if vendor.is_dir() else ():
            for path in sorted(library.iterdir()) if library.is_dir() else ():
                if path.is_file() and not path.name.startswith("."):
                    name = f"vendor/{library.name}/{path.name}"
                    found[name] = _asset(name, path)
    return found


ASSETS = load_assets()


def asset_for(path: str) -> Asset | None:
    """The asset a request path (`/console/static/<name>`) names, or None."""
    if not path.startswith(PREFIX):
        return None
    return ASSETS.get(path.removeprefix(PREFIX))


def asset_url(name: str) -> str:
    """The URL a page links `name` by (KeyError for a file the package does not have)."""
    return ASSETS[name].url
