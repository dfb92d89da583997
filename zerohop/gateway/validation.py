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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def nonnegative_int(value: Any, where: str) -> int:
    """`value` if it is an integer >= 0 (not a bool); ValueError naming `where` if not."""
    if not _is_int(value) or value < 0:
        raise ValueError(f"{where} must be an integer >= 0, not {value!r}")
    return value


def positive_int(value: Any, where: str) -> int:
    """`value` if it is an integer > 0 (not a bool); ValueError naming `where` if not."""
    if not _is_int(value) or value <= 0:
        raise ValueError(f"{where} must be an integer > 0, not {value!r}")
    return value


def limit(value: Any, where: str) -> int | None:
    """A limit: None (no limit) or an integer >= 0 (0: nothing allowed)."""
    return None if value is None else nonnegative_int(value, where)


def budget_tokens(value: Any, where: str) -> int:
    return positive_int(value, where)


def budget_period(value: Any, where: str) -> str:
    if value not in BUDGET_PERIODS:
        raise ValueError(f"{where} must be one of {', '.join(BUDGET_PERIODS)}, not {value!r}")
    return value


def weight(value: Any, where: str) -> float:
    """A fair-share weight: a finite number > 0 (not a bool, NaN or infinity), as float."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where} must be a finite number > 0, not {value!r}")
    return float(value)


def priority(value: Any, where: str) -> str:
    if value not in PRIORITY_CLASSES:
        raise ValueError(f"{where} must be one of {', '.join(PRIORITY_CLASSES)}, not {value!r}")
    return value


def unix_time(value: Any, where: str) -> float | None:
    """A time in unix seconds (expiry), or None: a finite number."""
    if value is None:
        return None
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not math.isfinite(value):
        raise ValueError(f"{where} must be a time in unix seconds, not {value!r}")
    return float(value)


def model_names(value: Any, where: str) -> tuple[str, ...]:
    """Allowed models: a list of non-empty names (empty: every model)."""
    if not isinstance(value, list | tuple) or not all(isinstance(m, str) and m for m in value):
        raise ValueError(f"{where} must be a list of model names, not {value!r}")
    return tuple(value)
