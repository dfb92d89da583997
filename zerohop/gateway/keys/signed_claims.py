"""The claims of a signed key (a JWT), and the `Identity` they stand for.

Claims (the JWT carries no `kid` claim: the key id is `sub`)
    sub            str, required     the key id (public: logs, audit, revocation)
    tenant         str, required     the tenant's name
    name           str               a label for the key ("")
    models         [str]             allowed models ([]: every model)
    priority       str               "interactive" (default) or "batch"
    limits         {rpm, itpm, otpm, max_concurrency}: ints >= 0 (0: nothing allowed),
                   each optional
    budget         {tokens: int > 0, period: "day" | "month" | "total" (default)}
    tenant_limits  like limits, for the whole tenant
    tenant_budget  like budget, for the whole tenant
    tenant_weight  finite number > 0, the tenant's fair-share weight (1.0)
    aud            str or [str], required: must contain the verifier's audience
                   ("zerohop" unless configured)
    exp            NumericDate: expiry; the verifier refuses a token without one unless the
                   server allows keys that never expire (--allow-nonexpiring-signed-keys)
    nbf            NumericDate: not valid before (optional)
    iat            NumericDate: issued at (informational; `zerohop keys sign` sets it)
    jti            str: the token's own id (`zerohop keys sign` sets a random one)
    Unknown top-level claims are ignored; unknown fields inside limits and budgets are
    refused (a typo such as "rmp" must not silently mean "unlimited"). Claims map to an
    `Identity` with source="jwt", its `Tenant` built from the tenant claims, expires_at=exp
    and extra={"jti": ..., "iat": ...}. The limit fields are `identity.LIMIT_FIELDS`; every
    value is checked by `zerohop.gateway.keys.validation`, as the CLI and the key store do.

`aud` is checked by the verifier (`zerohop.gateway.keys.signed_tokens`), with the signature; `exp`
and `nbf` are read here and compared with the clock there.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from zerohop.gateway.keys import validation
from zerohop.gateway.keys.identity import LIMIT_NAMES, Budget, Identity, Limits, Tenant

# A token's claims: the JSON object PyJWT decodes (its values are any JSON; each reader below
# checks the type of the claim it reads).
Claims = dict[str, Any]


def _limits_from(obj: Any, where: str) -> Limits:
    if obj is None:
        return Limits()
    if not isinstance(obj, dict):
        raise ValueError(f"claim {where!r} must be an object, not {obj!r}")
    unknown = sorted(set(obj) - set(LIMIT_NAMES))
    if unknown:
        raise ValueError(f"claim {where!r} has unknown fields {unknown} (known: {LIMIT_NAMES})")
    values = {k: validation.limit(obj.get(k), f"{where}.{k}") for k in LIMIT_NAMES}
    return Limits(**values)


def _budget_from(obj: Any, where: str) -> Budget | None:
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise ValueError(f"claim {where!r} must be an object, not {obj!r}")
    unknown = sorted(set(obj) - {"tokens", "period"})
    if unknown:
        raise ValueError(f"claim {where!r} has unknown fields {unknown} (known: tokens, period)")
    if "tokens" not in obj:
        raise ValueError(f"claim {where!r} has no 'tokens'")
    tokens = validation.budget_tokens(obj["tokens"], f"{where}.tokens")
    period = validation.budget_period(obj.get("period", "total"), f"{where}.period")
    return Budget(tokens, period)


def numeric_date(claims: Claims, name: str) -> float | None:
    """The time claim `name` (exp, nbf, iat) in unix seconds, or None; ValueError if bad."""
    return validation.unix_time(claims.get(name), f"claim {name!r}")


def iso_time(t: float) -> str:
    """Unix seconds as an ISO-8601 UTC time, for messages (repr if out of range)."""
    try:
        return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds")
    except (OverflowError, OSError, ValueError):
        return repr(t)


def identity_from_claims(claims: Claims) -> Identity:
    """The `Identity` a (verified) claims set stands for; ValueError names a bad claim."""
    sub = claims.get("sub")
    if not isinstance(sub, str) or not sub:
        raise ValueError("claim 'sub' (the key id) is missing or not a non-empty string")
    tenant = claims.get("tenant")
    if not isinstance(tenant, str) or not tenant:
        raise ValueError("claim 'tenant' is missing or not a non-empty string")
    name = claims.get("name", "")
    if not isinstance(name, str):
        raise ValueError(f"claim 'name' must be a string, not {name!r}")
    models = claims.get("models") or []
    if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
        raise ValueError(f"claim 'models' must be a list of model names, not {models!r}")
    priority = validation.priority(claims.get("priority", "interactive"), "claim 'priority'")
    weight = validation.weight(claims.get("tenant_weight", 1.0), "claim 'tenant_weight'")
    jti = claims.get("jti")
    if jti is not None and not isinstance(jti, str):
        raise ValueError(f"claim 'jti' must be a string, not {jti!r}")
    exp = numeric_date(claims, "exp")
    numeric_date(claims, "nbf")
    iat = numeric_date(claims, "iat")
    extra = {k: v for k, v in (("jti", jti), ("iat", iat)) if v is not None}
    admin = _flag(claims, "admin", False)
    return Identity(
        key_id=sub,
        tenant=Tenant(
            name=tenant,
            limits=_limits_from(claims.get("tenant_limits"), "tenant_limits"),
            budget=_budget_from(claims.get("tenant_budget"), "tenant_budget"),
            weight=weight,
        ),
        name=name,
        models=tuple(models),
        priority=priority,
        limits=_limits_from(claims.get("limits"), "limits"),
        budget=_budget_from(claims.get("budget"), "budget"),
        expires_at=exp,
        source="jwt",
        admin=admin,
        inference=_flag(claims, "inference", not admin),  # an admin key: admin only
        extra=extra,
    )


def _flag(claims: Claims, name: str, default: bool) -> bool:
    value = claims.get(name, default)
    if not isinstance(value, bool):
        raise ValueError(f"claim {name!r} must be true or false, not {value!r}")
    return value


def _limits_claim(limits: Limits) -> dict[str, int]:
    return {k: v for k, v in zip(LIMIT_NAMES, limits.values(), strict=True) if v is not None}


def claims_from_identity(identity: Identity) -> Claims:
    """The claims (all but aud, iat and jti, which `sign` adds) that `identity_from_claims`
    maps back to `identity`."""
    claims: Claims = {"sub": identity.key_id, "tenant": identity.tenant.name}
    if identity.name:
        claims["name"] = identity.name
    if identity.models:
        claims["models"] = list(identity.models)
    if identity.priority != "interactive":
        claims["priority"] = identity.priority
    for name, limits in (("limits", identity.limits), ("tenant_limits", identity.tenant.limits)):
        if limits.any():
            claims[name] = _limits_claim(limits)
    for name, budget in (("budget", identity.budget), ("tenant_budget", identity.tenant.budget)):
        if budget is not None:
            claims[name] = {"tokens": budget.tokens, "period": budget.period}
    if identity.tenant.weight != 1.0:
        claims["tenant_weight"] = identity.tenant.weight
    if identity.expires_at is not None:
        claims["exp"] = int(identity.expires_at)
    if identity.admin:
        claims["admin"] = True
    if identity.inference != (not identity.admin):
        claims["inference"] = identity.inference
    return claims
