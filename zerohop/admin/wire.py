"""The admin API's JSON: keys and tenants as it shows them, and the fields it accepts.

Keys take the shape of Anthropic's Admin API `api_key` object (a workspace is a zerohop
tenant), with zerohop's own fields under "zerohop". Every field a request sends is checked
here, where it enters, with `zerohop.gateway.keys.validation` and its name in the message.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from zerohop.gateway.keys import validation
from zerohop.gateway.keys.identity import LIMIT_NAMES, Budget, Limits, Tenant
from zerohop.gateway.store.rows import KeyRecord, TenantRow

KEY_STATUSES = ("active", "inactive", "archived")  # what an update may set
LIST_STATUSES = (*KEY_STATUSES, "expired")


def rfc3339(t: float | None) -> str | None:
    """RFC 3339 in UTC; None for None, and for a time no datetime holds (a row written by
    hand or an older zerohop: shown as no time rather than failing the whole answer)."""
    if t is None:
        return None
    try:
        moment = datetime.fromtimestamp(t, UTC)
    except (OverflowError, OSError, ValueError):
        return None
    return moment.isoformat(timespec="seconds").replace("+00:00", "Z")


def _unix(value: float, where: str) -> float:
    seconds = validation.unix_time(value, where)
    assert seconds is not None  # None only for None
    return seconds


def parse_time(value: Any, where: str) -> float:
    """Unix seconds from RFC 3339 text or a number (a string of one, from a query)."""
    if isinstance(value, bool):
        raise ValueError(f"{where} must be an RFC 3339 time or unix seconds, not {value!r}")
    if isinstance(value, int | float):
        return _unix(value, where)
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            pass
        else:
            return _unix(number, where)
        try:
            moment = datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
            moment = moment if moment.tzinfo else moment.replace(tzinfo=UTC)
            return _unix(moment.timestamp(), where)
        except (OverflowError, ValueError):
            raise ValueError(
                f"{where} is not an RFC 3339 time from 1970 on: {value[:40]!r}"
            ) from None
    raise ValueError(f"{where} must be an RFC 3339 time or unix seconds, not {value!r}")


def key_status(record: KeyRecord, now: float | None = None) -> str:
    if record.archived is not None:
        return "archived"
    if record.revoked is not None:
        return "inactive"
    if record.expires is not None and record.expires <= (now or time.time()):
        return "expired"
    return "active"


def api_key(record: KeyRecord, now: float | None = None) -> dict[str, Any]:
    creator = record.created_by
    return {
        "id": record.key_id,
        "type": "api_key",
        "name": record.name,
        "status": key_status(record, now),
        "created_at": rfc3339(record.created),
        "expires_at": rfc3339(record.expires),
        "created_by": None if creator is None else {"id": creator, "type": "user"},
        "partial_key_hint": record.key_id + "...",
        "workspace_id": record.tenant,
        "scope": {"type": "workspace", "workspace_id": record.tenant},
        "zerohop": {
            "admin": record.admin,
            "inference": record.inference,
            "models": record.models,
            "priority": record.priority,
            "limits": limits_json(record.limits),
            "budget": budget_json(record.budget),
            "problems": list(record.problems.values()),
        },
    }


def tenant_json(row: TenantRow, active_keys: int) -> dict[str, Any]:
    tenant = row.tenant
    return {
        "name": tenant.name,
        "weight": tenant.weight,
        "limits": limits_json(tenant.limits),
        "budget": budget_json(tenant.budget),
        "active_keys": active_keys,
        "problems": list(row.problems.values()),
    }


def limits_json(limits: Limits) -> dict[str, int | None]:
    return dict(zip(LIMIT_NAMES, limits.values(), strict=True))


def budget_json(budget: Budget | None) -> dict[str, Any] | None:
    return None if budget is None else {"tokens": budget.tokens, "period": budget.period}


# -- fields on the way in ---------------------------------------------------------------------


def merged_limits(value: Any, base: Limits, where: str = "limits") -> Limits:
    """`base` with the limits `value` names changed (a null removes one)."""
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be an object of {', '.join(LIMIT_NAMES)}")
    unknown = sorted(set(value) - set(LIMIT_NAMES))
    if unknown:
        raise ValueError(f"{where}: unknown limit {unknown[0]!r} (known: {', '.join(LIMIT_NAMES)})")
    fields = dict(zip(LIMIT_NAMES, base.values(), strict=True))
    for name, limit in value.items():
        fields[name] = validation.limit(limit, f"{where}.{name}")
    return Limits(**fields)


def budget_field(value: Any, where: str = "budget") -> Budget | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"tokens", "period"}:
        raise ValueError(f"{where} must be null or an object of tokens and period")
    tokens = validation.budget_tokens(value.get("tokens"), f"{where}.tokens")
    period = validation.budget_period(value.get("period", "total"), f"{where}.period")
    return Budget(tokens, period)


def text_field(value: Any, where: str, max_length: int = 200) -> str:
    if not isinstance(value, str) or len(value) > max_length:
        raise ValueError(f"{where} must be a string of at most {max_length} characters")
    return value


def name_field(value: Any, where: str) -> str:
    """A tenant's name: what `zerohop keys` accepts, and not empty."""
    text = text_field(value, where, 100)
    if not text.strip() or any(c in "/\\" or not c.isprintable() for c in text):
        raise ValueError(f"{where} must be a non-empty name without slashes or control characters")
    return text


def bool_field(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{where} must be true or false, not {value!r}")
    return value


def tenant_update(body: dict[str, Any], name: str, old: Tenant | None) -> Tenant:
    """The tenant `name` after the changes `body` asks for (`old`: as it is now, or None)."""
    unknown = sorted(set(body) - {"weight", "limits", "budget"})
    if unknown:
        raise ValueError(f"unknown tenant field {unknown[0]!r} (weight, limits, budget)")
    base = old or Tenant(name)
    weight = validation.weight(body["weight"], "weight") if "weight" in body else base.weight
    limits = merged_limits(body["limits"], base.limits) if "limits" in body else base.limits
    budget = budget_field(body["budget"]) if "budget" in body else base.budget
    return Tenant(name, limits, budget, weight)


def key_fields(body: dict[str, Any], base_limits: Limits) -> dict[str, Any]:
    """The store's `update_key` fields for the changes `body` asks for (not status)."""
    fields: dict[str, Any] = {}
    if "name" in body:
        fields["name"] = text_field(body["name"], "name")
    if "models" in body:
        fields["models"] = list(validation.model_names(body["models"] or [], "models"))
    if "priority" in body:
        fields["priority"] = validation.priority(body["priority"], "priority")
    if "expires_at" in body:
        value = body["expires_at"]
        fields["expires"] = None if value is None else parse_time(value, "expires_at")
    if "limits" in body:
        fields["limits"] = merged_limits(body["limits"], base_limits)
    if "budget" in body:
        fields["budget"] = budget_field(body["budget"])
    return fields
