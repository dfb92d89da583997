"""The authenticated caller and what it may do: `Identity`, its `Tenant`, `Limits`, `Budget`.

Authentication (`zerohop.gateway.auth`) maps every request to an `Identity`: a key of the
store (source "store"), a signed key (a JWT, source "jwt", built by
`zerohop.gateway.keys.signed_claims`), or `ANONYMOUS` when no key is configured. The identity
carries the key's allowed models, its priority class ("interactive" or "batch", which the
engine's scheduler serves in that order), its per-minute rate limits and concurrency cap
(`gateway.limits.buckets`) and its token budget (`gateway.budgets.sqlite_ledger`), and its
tenant's: the tenant has limits and a budget of its own, shared by all its keys, and a
fair-share weight that the scheduler (`zerohop.engine.sched.fair_share`) and the overload
estimates (`zerohop.api.load.overload`) use.

`LIMIT_FIELDS` is the one list of the limits (name, help text, rate-limiter bucket): the
`Limits` fields, the store's columns, the claims' fields and both `zerohop keys` CLIs' flags
are made from it. Every value is checked by `zerohop.gateway.keys.validation`, at each entry
(CLI flags, store rows, claims) with that entry's name for the field, and again when a
`Limits`, `Budget`, `Tenant` or `Identity` is made: none holds a negative limit, a weight
<= 0 (or NaN, infinity), a budget <= 0 or an unknown priority class or budget period.

A request refused for its key (revoked, expired, claims refused) stays anonymous; the
`KeyRef` of the key it presented travels with the refusal, so its audit record names the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from zerohop.gateway.keys import validation
from zerohop.gateway.keys.validation import BUDGET_PERIODS as BUDGET_PERIODS  # re-exported
from zerohop.gateway.keys.validation import PRIORITY_CLASSES as PRIORITY_CLASSES


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


@dataclass(slots=True, frozen=True)
class Limits:
    """Per-minute rates (token buckets of that capacity) and a concurrency cap; None: none.

    The fields are LIMIT_FIELDS, in that order (checked below)."""

    rpm: int | None = None  # requests per minute
    itpm: int | None = None  # uncached input tokens per minute
    otpm: int | None = None  # output tokens per minute
    max_concurrency: int | None = None  # requests in flight at once

    def __post_init__(self) -> None:
        for name in LIMIT_NAMES:
            validation.limit(getattr(self, name), name)

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
        validation.budget_tokens(self.tokens, "budget tokens")
        validation.budget_period(self.period, "budget period")


@dataclass(slots=True, frozen=True)
class Tenant:
    name: str
    limits: Limits = Limits()
    budget: Budget | None = None
    weight: float = 1.0  # fair-share weight: the scheduler serves tenants in proportion

    def __post_init__(self) -> None:
        validation.weight(self.weight, "weight")


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
    admin: bool = False  # may use the admin API and the console
    inference: bool = True  # may call the model (an admin key only when made so)
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)  # jwt: jti, iat

    def __post_init__(self) -> None:
        validation.priority(self.priority, "priority")

    def allows_model(self, model: str) -> bool:
        return not self.models or model in self.models

    def ref(self) -> KeyRef:
        return KeyRef(self.key_id, self.tenant.name)


@dataclass(slots=True, frozen=True)
class KeyRef:
    """A known key by its public names, never its secret: the key a refused request presented
    (revoked, expired, refused claims), which the audit names while the caller stays anonymous."""

    key_id: str
    tenant: str | None = None  # None: not known (a signed key whose claims name none)


ANONYMOUS = Identity(key_id="anonymous", tenant=Tenant("anonymous"), source="anonymous")
