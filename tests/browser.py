"""A real browser for the console's tests: Playwright driving Debian's chromium (`make
chromium` installs it; Playwright downloads nothing). Without /usr/bin/chromium (or the
playwright package) the tests that use it skip, or fail where ZEROHOP_REQUIRE_BROWSER=1 (set
by .ci/run), so CI cannot pass by skipping.

`launch_browser` is the body of a module-scoped fixture; `ConsoleTab` is a page that logs
every console message, page error and Content-Security-Policy violation it sees.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")
REQUIRE_ENV = "ZEROHOP_REQUIRE_BROWSER"
VIEWPORT = {"width": 1280, "height": 900}
# Registered before any page script runs (CDP injects it, so the CSP does not apply to it).
_WATCH_CSP = """
window.__cspViolations = [];
document.addEventListener("securitypolicyviolation", (e) => {
  window.__cspViolations.push(`${e.violatedDirective} blocked ${e.blockedURI || "inline"}`
    + ` at ${e.sourceFile || "?"}:${e.lineNumber}`);
});
"""


def require_browser() -> None:
    """Skip the test when there is no browser to drive (fail it where REQUIRE_ENV=1)."""
    reason = None
    if not CHROMIUM.exists():
        reason = f"{CHROMIUM} is not installed: `make chromium` installs Debian's chromium"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            reason = "the playwright package is not installed (pip install -e '.[test]')"
    if reason is None:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1)")
    pytest.skip(reason)


def launch_browser() -> Iterator[Any]:
    """The body of a module-scoped fixture: one headless chromium, closed at the end (not
    session-scoped: while Playwright's sync API is open, asyncio.run fails in this thread)."""
    require_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


@dataclass
class ConsoleTab:
    """A fresh browser context (its own cookies) whose pages record what the browser logs:
    console messages, uncaught errors, CSP violations. `page` is its first page."""

    context: Any
    pages: list[Any] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)

    @classmethod
    def open(cls, browser: Any, viewport: dict[str, int] = VIEWPORT) -> ConsoleTab:
        context = browser.new_context(viewport=viewport)
        context.add_init_script(_WATCH_CSP)
        tab = cls(context)
        tab.new_page()
        return tab

    @property
    def page(self) -> Any:
        return self.pages[0]

    def new_page(self) -> Any:
        page = self.context.new_page()
        page.on("console", lambda m: self.messages.append(f"console.{m.type}: {m.text}"))
        page.on("pageerror", lambda e: self.messages.append(f"pageerror: {e}"))
        self.pages.append(page)
        return page

    def close(self) -> None:
        self.context.close()

    def csp_violations(self) -> list[str]:
        """Violations the pages' listeners saw, plus any the browser logged."""
        seen = [v for page in self.pages for v in page.evaluate("window.__cspViolations || []")]
        logged = [m for m in self.messages if "Content Security Policy" in m]
        return [*seen, *logged]

    def problems(self, allowed: tuple[str, ...] = ()) -> list[str]:
        """Errors and warnings logged so far (but those containing an `allowed` text), and
        every CSP violation."""
        bad = [m for m in self.messages if not m.startswith(("console.log", "console.info"))]
        return [m for m in bad if not any(a in m for a in allowed)] + self.csp_violations()


def _rgb(png: bytes) -> Any:
    """A PNG screenshot as a height x width x 3 array."""
    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(png)) as image:
        return np.asarray(image.convert("RGB"), dtype=np.int16)


def distinct_colours(png: bytes) -> int:
    """How many colours a PNG screenshot holds (1: a flat area, nothing drawn)."""
    pixels = _rgb(png).reshape(-1, 3)
    return len({tuple(p) for p in pixels.tolist()})


def pixels_near(png: bytes, rgb: tuple[int, int, int], tolerance: int = 40) -> int:
    """How many pixels of a PNG screenshot are within `tolerance` (per channel) of `rgb`: a
    chart's series drawn in that colour."""
    close = abs(_rgb(png) - rgb) <= tolerance
    return int(close.all(axis=2).sum())
