"""Rows of the key store read back as records, every field checked on the way in.

A row may have been written by an older version (which took a budget of 0 or a weight of -1)
or by hand with sqlite3, so each field goes through `zerohop.gateway.keys.validation` like a CLI
flag or a claim does. A bad field does not stop the read: the record holds a harmless
placeholder for it (no limit, no budget, weight 1) and names the field in `problems`
({"tenants.weight": "tenants.weight of tenant 'neg' must be ..."}), so that

- the server refuses the key (`InvalidKey`: 403 "this key's configuration is invalid",
  naming the fields; a key of a tenant whose row is bad is refused the same way) and logs
  the row and field, while every other key is served;
- `zerohop keys list|show` shows the row as "invalid", and `zerohop keys update|tenant`
  repair it (they refuse to write a placeholder back: each bad field must be given).

A revoked key's row is read as a `RevokedKey` (its id and tenant only): the server refuses
it as it refuses an unknown key, and its audit records name it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

from zerohop.gateway.keys import validation
from zerohop.gateway.keys.identity import LIMIT_NAMES, Budget, Identity, KeyRef, Limits, Tenant

Problems = dict[str, str]  # "table.column" -> what is wrong with it
Row = Mapping[str, Any]  # a sqlite3.Row, or a dict_row of PostgreSQL


@dataclass(slots=True)
class KeyRecord:
    """One row of `keys`, as the CLI shows it; `problems` names its invalid fields."""

    key_id: str
    tenant: str
    name: str
    created: float
    expires: float | None
    revoked: float | None
    models: list[str]
    priority: str
    limits: Limits
    budget: Budget | None
    admin: bool = False  # an admin key: the admin API and the console
    inference: bool = True  # may call the model
    archived: float | None = None  # revoked for good (the admin API's "archived")
    created_by: str | None = None  # the admin key that made it (None: the CLI)
    problems: Problems = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = {
            "key_id": self.key_id,
            "tenant": self.tenant,
            "name": self.name,
            "created": self.created,
            "expires": self.expires,
            "revoked": self.revoked,
            "models": self.models,
            "priority": self.priority,
            "limits": dict(zip(LIMIT_NAMES, self.limits.values(), strict=True)),
            "budget": None if self.budget is None else budget_dict(self.budget),
            "admin": self.admin,
            "inference": self.inference,
            "archived": self.archived,
            "created_by": self.created_by,
        }
        if self.problems:
            out["problems"] = list(self.problems.values())
        return out


class KeyFields(TypedDict, total=False):
    """A key's fields that `create_key` sets and `update_key` changes."""

    name: str
    expires: float | None
    models: list[str] | None
    priority: str
    limits: Limits
    budget: Budget | None
    admin: bool
    inference: bool


class NewKey(KeyFields, total=False):
    """What `create_key` makes a key with beside its tenant (each has a default: `key_values`)."""

    created_by: str | None


def key_values(fields: NewKey) -> tuple[Any, ...]:
    """A new key's columns after its id, hash, tenant, name and creation time, in either
    store's `_INSERT_KEY` order, with the defaults filled in."""
    limits = fields.get("limits") or Limits()
    budget = fields.get("budget")
    budget_columns = (None, None) if budget is None else (budget.tokens, budget.period)
    return (
        fields.get("expires"), json.dumps(fields.get("models") or []),
        fields.get("priority", "interactive"), *limits.values(), *budget_columns,
        int(fields.get("admin", False)), int(fields.get("inference", True)),
        fields.get("created_by"),
    )  # fmt: skip


class KeyChanges(KeyFields, total=False):
    """What `update_key` may change of a key (each field given is set, None included)."""

    tenant: str
    revoked: float | None
    archived: float | None


@dataclass(slots=True)
class TenantRow:
    """One row of `tenants`; `problems` names its invalid fields."""

    tenant: Tenant
    problems: Problems = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class InvalidKey:
    """A key whose row (or whose tenant's row) holds an invalid value: refused, not served."""

    key_id: str
    problems: tuple[str, ...]  # the messages, for the log
    fields: tuple[str, ...]  # "table.column", for the client
    tenant: str | None = None  # the row's tenant, for the audit

    def ref(self) -> KeyRef:
        return KeyRef(self.key_id, self.tenant)


@dataclass(slots=True, frozen=True)
class RevokedKey:
    """A revoked (or archived) key: refused as an unknown key is, but named in the audit."""

    key_id: str
    tenant: str

    def ref(self) -> KeyRef:
        return KeyRef(self.key_id, self.tenant)


KeyEntry = Identity | InvalidKey | RevokedKey  # what a snapshot maps a secret's hash to


@dataclass(slots=True, frozen=True)
class KeyRows:
    """One consistent read of the keys a server serves, as the store's rows: what a fleet
    replica indexes, and keeps a local copy of (`zerohop.gateway.store.key_snapshot`)."""

    version: int  # the store's keys_version at the read
    tenants: list[dict[str, Any]]
    keys: list[dict[str, Any]]  # every key, revoked ones included

    @property
    def has_keys(self) -> bool:
        return bool(self.keys)

    def index(self) -> dict[str, KeyEntry]:
        """secret hash -> what each key is served as (`key_entry`)."""
        tenants = {r.tenant.name: r for r in map(tenant_row, self.tenants)}
        index: dict[str, KeyEntry] = {}
        for row in self.keys:
            record = key_record(row)
            index[row["secret_sha256"]] = key_entry(record, tenants.get(record.tenant))
        return index


def budget_dict(budget: Budget) -> dict[str, Any]:
    return {"tokens": budget.tokens, "period": budget.period}


class _Fields:
    """Reads the fields of one row through the validators, noting each bad one."""

    def __init__(self, row: Row, table: str, what: str) -> None:
        self.row, self.table, self.what = row, table, what
        self.problems: Problems = {}

    def where(self, column: str) -> str:
        return f"{self.table}.{column} of {self.what}"

    def get(self, column: str, check: Callable[[Any, str], Any], default: Any) -> Any:
        try:
            return check(self.row[column], self.where(column))
        except ValueError as exc:
            self.problems[f"{self.table}.{column}"] = str(exc)
            return default

    def limits(self) -> Limits:
        return Limits(**{c: self.get(c, validation.limit, None) for c in LIMIT_NAMES})

    def budget(self) -> Budget | None:
        if self.row["budget_tokens"] is None:
            return None
        tokens = self.get("budget_tokens", validation.budget_tokens, None)
        period = self.get("budget_period", _period, None)
        return None if tokens is None or period is None else Budget(tokens, period)

    def models(self) -> list[str]:
        return list(self.get("models", _models, ()))


def _period(value: Any, where: str) -> str:
    return validation.budget_period("total" if value is None else value, where)


def _models(value: Any, where: str) -> tuple[str, ...]:
    try:
        names = json.loads(value) if isinstance(value, str) else value
    except ValueError:
        raise ValueError(f"{where} is not JSON: {value!r}") from None
    return validation.model_names(names, where)


def _flag(value: Any, where: str) -> bool:
    # 0/1 in both stores' integer columns (a PostgreSQL boolean, True/False, reads the same)
    if value in (0, 1) and not isinstance(value, float):
        return bool(value)
    raise ValueError(f"{where} must be 0 or 1 (false or true), not {value!r}")


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where} must be text, not {value!r}")
    return value


def tenant_row(row: Row) -> TenantRow:
    f = _Fields(row, "tenants", f"tenant {row['name']!r}")
    tenant = Tenant(row["name"], f.limits(), f.budget(), f.get("weight", validation.weight, 1.0))
    return TenantRow(tenant, f.problems)


def key_record(row: Row) -> KeyRecord:
    f = _Fields(row, "keys", f"key {row['key_id']!r}")
    return KeyRecord(
        key_id=row["key_id"],
        tenant=row["tenant"],
        name=f.get("name", _text, ""),
        created=row["created"],
        expires=f.get("expires", validation.unix_time, None),
        revoked=row["revoked"],
        models=f.models(),
        priority=f.get("priority", validation.priority, "interactive"),
        limits=f.limits(),
        budget=f.budget(),
        admin=f.get("admin", _flag, False),
        inference=f.get("inference", _flag, True),
        archived=row["archived"],
        created_by=row["created_by"],
        problems=f.problems,
    )


def key_entry(record: KeyRecord, tenant: TenantRow | None) -> KeyEntry:
    """What a snapshot holds for a key: RevokedKey once it is revoked, else `key_identity`."""
    if record.revoked is not None:
        return RevokedKey(record.key_id, record.tenant)
    return key_identity(record, tenant)


def key_identity(record: KeyRecord, tenant: TenantRow | None) -> Identity | InvalidKey:
    """What the server serves a key as: its Identity, or InvalidKey when its row or its
    tenant's row (or the lack of one) is invalid."""
    problems = dict(record.problems)
    if tenant is None:
        missing = f"keys.tenant of key {record.key_id!r}: no tenant {record.tenant!r}"
        problems["keys.tenant"] = missing
    else:
        problems |= tenant.problems
    if problems or tenant is None:
        return InvalidKey(record.key_id, tuple(problems.values()), tuple(problems), record.tenant)
    return Identity(
        key_id=record.key_id,
        tenant=tenant.tenant,
        name=record.name,
        models=tuple(record.models),
        priority=record.priority,
        limits=record.limits,
        budget=record.budget,
        expires_at=record.expires,
        admin=record.admin,
        inference=record.inference,
    )
