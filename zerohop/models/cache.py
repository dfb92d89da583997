"""Where zerohop keeps the models it fetches or builds: `$XDG_CACHE_HOME/zerohop/models`."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "zerohop" / "models"
