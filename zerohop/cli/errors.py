"""The one line a failed `zerohop` command prints instead of a traceback.

A command that cannot do its job for a reason outside the program (a refused start-up, a
file or database it cannot use, a peer it cannot reach) says so in one line on stderr and
exits 1. Anything else is a bug and keeps its traceback; `ZEROHOP_TRACEBACK=1` keeps it for
the expected failures too.
"""

from __future__ import annotations

import importlib
import os
import sqlite3
from pathlib import Path

TRACEBACK_ENV = "ZEROHOP_TRACEBACK"


def failure_line(exc: BaseException, keys_db: Path | None = None) -> str | None:
    """What went wrong in one line, or None when `exc` is a bug (or tracebacks are asked)."""
    if os.environ.get(TRACEBACK_ENV):
        return None
    from zerohop.gateway.store.spec import StoreUnavailable

    if isinstance(exc, StoreUnavailable):  # names the store, its password masked
        return _words(exc)
    if isinstance(exc, sqlite3.Error):
        return f"the key store {keys_db or _default_keys_db()}: {_words(exc)}"
    if isinstance(exc, _http_errors()):  # before OSError: aiohttp's connect errors are both
        return _words(exc)
    if isinstance(exc, OSError):
        return _os_error(exc)
    if isinstance(exc, _refusals()):
        return _words(exc)
    return None


def _refusals() -> tuple[type[BaseException], ...]:
    """Failures whose message is meant for the user: start-up refusals, bad input files."""
    from zerohop.engine.base.errors import ZerohopError
    from zerohop.gateway.gateway import GatewayStartError

    return (ZerohopError, GatewayStartError, RuntimeError, ValueError)


def _http_errors() -> tuple[type[BaseException], ...]:
    """A peer that refused or broke off, for each HTTP client that is installed."""
    kinds = []
    for module, name in (
        ("httpx", "HTTPError"),
        ("httpx2", "HTTPError"),
        ("aiohttp", "ClientError"),
    ):
        try:
            kinds.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return tuple(kinds)


def _os_error(exc: OSError) -> str:
    """`/x: No such file or directory` rather than `[Errno 2] No such file ...: '/x'`."""
    if exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    return exc.strerror or _words(exc)


def _words(exc: BaseException) -> str:
    """The message on one line (or the exception's name when it has none)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def _default_keys_db() -> Path:
    from zerohop.gateway.store.sqlite import default_db_path

    return default_db_path()
