"""The authenticated caller and what it may do: `Identity`, its `Tenant`, `Limits`, `Budget`.

Authentication (`zerohop.gateway.auth`) maps every request to an `Identity`: a key of the
store (source "store"), a signed key (a JWT, source "jwt", built by
`zerohop.gateway.signed_claims`), or `ANONYMOUS` when no key is configured. The identity
carries the key's allowed models, its priority class ("interactive" or "batch", which the
engine's scheduler serves in that order), its per-minute rate limits and concurrency cap
(`zerohop.gateway.limits`) and its token budget (`zerohop.gateway.budget`), and its
tenant's: the tenant has limits and a budget of its own, shared by all its keys, and a
fair-share weight that the scheduler (`zerohop.engine.fair_share`) and the overload
estimates (`zerohop.api.overload`) use.

`LIMIT_FIELDS` is the one list of the limits (name, help text, rate-limiter bucket): the
`Limits` fields, the store's columns, the claims' fields and both `zerohop keys` CLIs' flags
are made from it, and `nonnegative_int` is the one check of their values.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

PRIORITY_CLASSES = ("interactive", "batch")
BUDGET_PERIODS = ("day", "month", "total")


@dataclass(slots=True, frozen=True)
class LimitField:
    """One limit of a key or tenant: a `Limits` field, a store column, a claims field."""

    name: str  # the field, column and claim name
    help: str  # the CLI flags' help text
    bucket: str | None  # the rate limiter's token bucket kind; None: not a rate

    @property
    def flag(self) -> str:
        """The CLI flag's name without "--" (and without a "tenant-" prefix)."""
        return self.name.replace("_", "-")


LIMIT_FIELDS = (
    LimitField("rpm", "requests per minute", "requests"),
    LimitField("itpm", "uncached input tokens per minute", "input_tokens"),
    LimitField("otpm", "output tokens per minute", "output_tokens"),
    LimitField("max_concurrency", "requests in flight at once", None),
)
LIMIT_NAMES = tuple(f.name for f in LIMIT_FIELDS)


def nonnegative_int(value: Any, where: str) -> int:
    """`value` if it is an integer >= 0 (not a bool); ValueError naming `where` if not."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where} must be an integer >= 0, not {value!r}")
    return value


@dataclass(slots=True, frozen=True)
class Limits:
    """Per-minute rates (token buckets of that capacity) and a concurrency cap; None: none.

    The fields are LIMIT_FIELDS, in that order (checked below)."""

    rpm: int | None = None  # requests per minute
    itpm: int | None = None  # uncached input tokens per minute
    otpm: int | None = None  # output tokens per minute
    max_concurrency: int | None = None  # requests in flight at once

    def any(self) -> bool:
        return any(getattr(self, name) is not None for name in LIMIT_NAMES)

    def values(self) -> tuple[int | None, ...]:
        """The limits in LIMIT_FIELDS order."""
        return tuple(getattr(self, name) for name in LIMIT_NAMES)


assert tuple(f.name for f in fields(Limits)) == LIMIT_NAMES, "Limits and LIMIT_FIELDS differ"


@dataclass(slots=True, frozen=True)
class Budget:
    """A number of tokens (uncached input + output) per UTC day, per UTC month, or in total."""

    tokens: int
    period: str = "total"

    def __post_init__(self) -> None:
        assert self.tokens >= 0 and self.period in BUDGET_PERIODS, self


@dataclass(slots=True, frozen=True)
class Tenant:
    name: str
    limits: Limits = Limits()
    budget: Budget | None = None
    weight: float = 1.0  # fair-share weight: the scheduler serves tenants in proportion


@dataclass(slots=True, frozen=True)
class Identity:
    """An authenticated caller. `key_id` is public (logs, audit); the secret never is."""

    key_id: str
    tenant: Tenant
    name: str = ""
    models: tuple[str, ...] = ()  # allowed models; empty: every model
    priority: str = "interactive"
    limits: Limits = Limits()
    budget: Budget | None = None
    expires_at: float | None = None  # unix seconds
    source: str = "store"  # "store", "jwt" or "anonymous"
    extra: dict = field(default_factory=dict, compare=False, hash=False)  # jwt: jti, iat

    def allows_model(self, model: str) -> bool:
        return not self.models or model in self.models


ANONYMOUS = Identity(key_id="anonymous", tenant=Tenant("anonymous"), source="anonymous")
