"""The one check of every configured value of a key or tenant, wherever it enters.

`zerohop keys create|update|tenant|sign` (their argparse types), the key store when it is
read (a row written by an older version or by hand), signed-key claims and the `Limits`,
`Budget`, `Tenant` and `Identity` dataclasses themselves all call these functions, so one
value means the same everywhere and is refused with the same words. Each takes the value
and `where` (the field as that entry names it: "--weight", "limits.rpm", "tenants.weight
of tenant 'acme'") and returns the value, or raises ValueError naming `where`.

What is allowed
    limits (rpm, itpm, otpm, max_concurrency)  an integer >= 0, or none; 0 means nothing
                                                is allowed (every request is refused, 429)
    budget tokens                               an integer > 0 (no budget: none at all)
    budget period                               "day", "month" or "total"
    tenant weight                               a finite number > 0
    priority                                    "interactive" or "batch"
"""

from __future__ import annotations

import math
from typing import Any

PRIORITY_CLASSES = ("interactive", "batch")
BUDGET_PERIODS = ("day", "month", "total")
MAX_INT = 2**63 - 1  # what a store column (SQLite INTEGER, PostgreSQL bigint) holds
LATEST_TIME = 253_402_300_800.0  # 10000-01-01T00:00:00Z: datetime ends before it


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def nonnegative_int(value: Any, where: str) -> int:
    """`value` if it is an integer >= 0 (not a bool) that a store column (64-bit signed)
    holds; ValueError naming `where` if not."""
    if not _is_int(value) or value < 0:
        raise ValueError(f"{where} must be an integer >= 0, not {value!r}")
    return _at_most_max(value, where)


def positive_int(value: Any, where: str) -> int:
    """`value` if it is an integer > 0 (not a bool) that a store column holds."""
    if not _is_int(value) or value <= 0:
        raise ValueError(f"{where} must be an integer > 0, not {value!r}")
    return _at_most_max(value, where)


def _at_most_max(value: int, where: str) -> int:
    if value > MAX_INT:
        raise ValueError(f"{where} must be at most {MAX_INT} (what the store holds)")
    return value


def limit(value: Any, where: str) -> int | None:
    """A limit: None (no limit) or an integer >= 0 (0: nothing allowed)."""
    return None if value is None else nonnegative_int(value, where)


def budget_tokens(value: Any, where: str) -> int:
    return positive_int(value, where)


def budget_period(value: Any, where: str) -> str:
    if value not in BUDGET_PERIODS:
        raise ValueError(f"{where} must be one of {', '.join(BUDGET_PERIODS)}, not {value!r}")
    return str(value)


def weight(value: Any, where: str) -> float:
    """A fair-share weight: a finite number > 0 (not a bool, NaN or infinity), as float."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where} must be a finite number > 0, not {value!r}")
    return float(value)


def priority(value: Any, where: str) -> str:
    if value not in PRIORITY_CLASSES:
        raise ValueError(f"{where} must be one of {', '.join(PRIORITY_CLASSES)}, not {value!r}")
    return str(value)


def unix_time(value: Any, where: str) -> float | None:
    """A time in unix seconds (expiry), or None: a number from 1970 to the year 9999."""
    if value is None:
        return None
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or not 0 <= value < LATEST_TIME:
        raise ValueError(f"{where} must be a time in unix seconds (1970-9999), not {value!r}")
    return float(value)


def model_names(value: Any, where: str) -> tuple[str, ...]:
    """Allowed models: a list of non-empty names (empty: every model)."""
    if not isinstance(value, list | tuple) or not all(isinstance(m, str) and m for m in value):
        raise ValueError(f"{where} must be a list of model names, not {value!r}")
    return tuple(value)
