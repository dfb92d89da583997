"""An `Identity` as JSON and back: what a batch made with a signed (JWT) key keeps, so that its
lines run as that caller later, on any replica, though no store holds the key.

A stored key is looked up again for every line (its revocation or new limits apply at once);
a signed key cannot be, so its snapshot is checked instead (`signed_identity_now`): a line
runs only while the token's expiry has not passed, its key id (`sub`) and token id (`jti`) are
not in the verifier's revoked file, and the server still accepts signed keys at all.
"""

from __future__ import annotations

import time
from typing import Any

from zerohop.gateway.keys.identity import Budget, Identity, Limits, Tenant


def snapshot(identity: Identity) -> dict[str, Any]:
    tenant = identity.tenant
    return {
        "key_id": identity.key_id,
        "tenant": {
            "name": tenant.name,
            "limits": _limits(tenant.limits),
            "budget": _budget(tenant.budget),
            "weight": tenant.weight,
        },
        "name": identity.name,
        "models": list(identity.models),
        "priority": identity.priority,
        "limits": _limits(identity.limits),
        "budget": _budget(identity.budget),
        "expires_at": identity.expires_at,
        "source": identity.source,
        "inference": identity.inference,
        "extra": {k: v for k, v in identity.extra.items() if isinstance(v, str | int | float)},
    }


def restore(data: dict[str, Any]) -> Identity:
    """The identity `snapshot` gave (ValueError or KeyError for a damaged one)."""
    tenant = data["tenant"]
    return Identity(
        key_id=data["key_id"],
        tenant=_tenant_of(tenant),
        name=data["name"],
        models=tuple(data["models"]),
        priority=data["priority"],
        limits=Limits(**data["limits"]),
        budget=_budget_of(data["budget"]),
        expires_at=data["expires_at"],
        source=data["source"],
        inference=data["inference"],
        extra=dict(data["extra"]),
    )


def signed_identity_now(data: dict[str, Any], revoked: frozenset[str] | None) -> Identity | None:
    """A signed key's snapshot as it may serve now; None once expired or revoked, or when the
    server no longer verifies signed keys (`revoked` None)."""
    if revoked is None:
        return None
    try:
        identity = restore(data)
    except (KeyError, TypeError, ValueError):
        return None
    if identity.expires_at is not None and time.time() >= identity.expires_at:
        return None
    if identity.key_id in revoked or identity.extra.get("jti") in revoked:
        return None
    return identity if identity.inference else None


def _tenant_of(data: dict[str, Any]) -> Tenant:
    limits, budget = Limits(**data["limits"]), _budget_of(data["budget"])
    return Tenant(data["name"], limits, budget, data["weight"])


def _limits(limits: Limits) -> dict[str, int | None]:
    return {
        "rpm": limits.rpm,
        "itpm": limits.itpm,
        "otpm": limits.otpm,
        "max_concurrency": limits.max_concurrency,
    }


def _budget(budget: Budget | None) -> dict[str, Any] | None:
    return None if budget is None else {"tokens": budget.tokens, "period": budget.period}


def _budget_of(data: dict[str, Any] | None) -> Budget | None:
    return None if data is None else Budget(data["tokens"], data["period"])
