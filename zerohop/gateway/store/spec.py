"""Where the key store is (`--store URL`, `--keys-db PATH`), said without its password, and
the one-line error for a store that cannot be used.

A PostgreSQL URL may carry a password (`postgresql://user:secret@host/db`, or
`?password=secret`): `describe()` and every `StoreUnavailable` message mask it, so it never
reaches a log line, an error or `repr()`. The password belongs in the environment
(`ZEROHOP_STORE`, `PGPASSWORD`) or `~/.pgpass`, never on a command line, where `ps` shows it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import unquote, urlsplit, urlunsplit

STORE_ENV = "ZEROHOP_STORE"  # the default of --store, for `serve`, `keys` and `store`
PG_SCHEMES = ("postgresql", "postgres")
MASK = "***"
_QUERY_PASSWORD = re.compile(r"(?i)(^|&)(password=)[^&]*")

StoreKind = Literal["sqlite", "postgresql"]


class StoreUnavailable(Exception):
    """The key store cannot be used now (down, unreachable, refused, unmigrated): the
    message is one line, naming the store with its password masked."""

    @classmethod
    def wrap(cls, exc: BaseException, url: str) -> StoreUnavailable:
        return cls(f"the key store {mask_password(url)}: {mask_in(one_line(exc), url)}")


class SchemaMismatch(StoreUnavailable):
    """The store's schema is missing, older than this zerohop needs, or newer than it reads."""


@dataclass(frozen=True, slots=True, repr=False)
class StoreSpec:
    kind: StoreKind
    target: str  # the URL, or the SQLite file's path

    @classmethod
    def parse(cls, text: str) -> StoreSpec:
        """A `postgresql://` or `postgres://` URL, a `sqlite:///path` or a plain path."""
        text = text.strip()
        if not text:
            raise ValueError("the key store: an empty URL or path")
        scheme = text.partition("://")[0].lower()
        if scheme in PG_SCHEMES:
            return cls("postgresql", text)
        if scheme == "sqlite":
            text = text.partition("://")[2] or text
        return cls.sqlite(Path(text))

    @classmethod
    def sqlite(cls, path: Path) -> StoreSpec:
        return cls("sqlite", str(Path(path).expanduser()))

    @property
    def path(self) -> Path:
        if self.kind != "sqlite":
            raise ValueError(f"{self.describe()} is not a SQLite file")
        return Path(self.target)

    @property
    def url(self) -> str:
        if self.kind != "postgresql":
            raise ValueError(f"{self.describe()} is not a PostgreSQL URL")
        return self.target

    def describe(self) -> str:
        return mask_password(self.target) if self.kind == "postgresql" else self.target

    def __repr__(self) -> str:
        return f"StoreSpec({self.kind!r}, {self.describe()!r})"


def store_text(flag: str | None) -> str | None:
    """--store as given, else $ZEROHOP_STORE; None when neither is set (or both empty)."""
    return flag or os.environ.get(STORE_ENV) or None


def mask_password(url: str) -> str:
    """`url` with the password of its user part and of a `password=` parameter masked."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return MASK  # not even a URL: show nothing of it
    user, at, host = parts.netloc.rpartition("@")
    if at and ":" in user:
        user = user.partition(":")[0] + ":" + MASK
    netloc = f"{user}@{host}" if at else host
    query = _QUERY_PASSWORD.sub(rf"\1\2{MASK}", parts.query)
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def mask_in(text: str, url: str) -> str:
    """`text` (an error message) with every password `url` holds replaced by the mask."""
    for secret in _passwords(url):
        text = text.replace(secret, MASK)
    return text


def _passwords(url: str) -> set[str]:
    try:
        parts = urlsplit(url)
    except ValueError:
        return set()
    found = set()
    user, at, _host = parts.netloc.rpartition("@")
    if at and ":" in user:
        found.add(user.partition(":")[2])
    for item in parts.query.split("&"):
        name, _, value = item.partition("=")
        if name.lower() == "password":
            found.add(value)
    found |= {unquote(s) for s in found}
    return {s for s in found if s}


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
