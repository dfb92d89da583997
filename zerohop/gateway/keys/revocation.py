"""The revoked file of signed keys (`--revoked FILE`): the key ids and token ids refused.

One key id (`sub`) or token id (`jti`) per line; blank lines and `#` comments are ignored.
The verifier (`zerohop.gateway.keys.signed_tokens`) calls `reload` at most once per
`check_interval` (default 1 s, from `verify`: a stat(), a few microseconds); the file is
re-read only when its mtime, size or inode changed. A file that disappears or cannot be read
keeps the previous list (and is logged); at start-up it must be readable.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

REVOKED_CHECK_INTERVAL = 1.0  # seconds between two stat()s of the revoked file


class RevokedFile:
    """The ids listed in one revoked file (`ids`), kept up to date by `reload`."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        check_interval: float = REVOKED_CHECK_INTERVAL,
        clock: Callable[[], float],
    ) -> None:
        self.path = Path(path)
        self.check_interval = check_interval
        self._clock = clock
        self.ids: frozenset[str] = frozenset()
        self._sig: tuple[int, int, int] | None = None
        self._missing_logged = False
        try:
            st = os.stat(self.path)
        except OSError as e:
            raise ValueError(f"cannot read revoked file {self.path}: {e.strerror}") from None
        self._load(st, strict=True)
        self.next_check = clock() + check_interval  # when `reload` is due (the verifier's)

    def reload(self) -> None:
        """Re-read the file now if it changed."""
        self.next_check = self._clock() + self.check_interval
        try:
            st = os.stat(self.path)
        except OSError as e:
            if not self._missing_logged:
                log.warning(
                    "revoked file %s: %s; keeping the %d revoked ids read before",
                    self.path,
                    e.strerror,
                    len(self.ids),
                )
                self._missing_logged = True
            return
        self._missing_logged = False
        if (st.st_mtime_ns, st.st_size, st.st_ino) != self._sig:
            self._load(st, strict=False)

    def _load(self, st: os.stat_result, *, strict: bool) -> None:
        path = self.path
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            if strict:
                raise ValueError(f"cannot read revoked file {path}: {e}") from None
            log.warning("revoked file %s: %s; keeping the previous list", path, e)
            return
        revoked = set()
        for line in text.splitlines():
            entry = line.split("#", 1)[0].strip()
            if entry:
                revoked.add(entry)
        self.ids = frozenset(revoked)
        self._sig = (st.st_mtime_ns, st.st_size, st.st_ino)
        log.info("revoked file %s: %d key ids / token ids", path, len(revoked))
