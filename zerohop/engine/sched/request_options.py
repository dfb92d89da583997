"""The scheduler's view of a request's caller (tenant, weight, priority class, cache salt),
validated where a request enters the engine: these come from keys and tenants an operator
configured, or from a client of the offline API, so a bad one refuses that request only."""

from __future__ import annotations

import math

from zerohop.engine.base.errors import InvalidRequestError


def check_request_options(
    tenant: object, weight: object, priority: object, cache_salt: object
) -> None:
    """Raise InvalidRequestError naming the first field that cannot be scheduled."""
    if not isinstance(tenant, str):
        raise InvalidRequestError(f"tenant must be a string, not {type(tenant).__name__}")
    check_weight(weight)
    if isinstance(priority, bool) or not isinstance(priority, int) or priority < 0:
        raise InvalidRequestError(f"priority must be a class number >= 0, not {priority!r}")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise InvalidRequestError("cache_salt must be a string")


def check_weight(weight: object) -> None:
    """A tenant's fair-share weight is a finite number above 0."""
    number = weight if isinstance(weight, int | float) and not isinstance(weight, bool) else None
    if number is None or not math.isfinite(number) or number <= 0:
        raise InvalidRequestError(
            f"the tenant's fair-share weight must be a positive number, not {weight!r}"
        )
