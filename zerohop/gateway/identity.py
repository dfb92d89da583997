"""Who a request comes from, once authenticated: a key, its tenant, their limits and budgets."""

from __future__ import annotations

from dataclasses import dataclass, field

PRIORITY_CLASSES = ("interactive", "batch")
BUDGET_PERIODS = ("day", "month", "total")


@dataclass(slots=True, frozen=True)
class Limits:
    """Per-minute rates (token buckets of that capacity) and a concurrency cap; None: none."""

    rpm: int | None = None  # requests per minute
    itpm: int | None = None  # uncached input tokens per minute
    otpm: int | None = None  # output tokens per minute
    max_concurrency: int | None = None  # requests in flight at once

    def any(self) -> bool:
        return any(v is not None for v in (self.rpm, self.itpm, self.otpm, self.max_concurrency))


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
    weight: float = 1.0  # fair-share weight (the scheduler's, next capability)


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
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def allows_model(self, model: str) -> bool:
        return not self.models or model in self.models


ANONYMOUS = Identity(key_id="anonymous", tenant=Tenant("anonymous"), source="anonymous")
