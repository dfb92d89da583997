"""`zerohop keys`: create, list, show, update and revoke keys, set tenants, show usage.

Works on the store the server reads: its SQLite file (`--keys-db`), or a fleet's PostgreSQL
(`--store URL`, by default $ZEROHOP_STORE, where a password belongs); a running server (every
replica, for PostgreSQL) picks up every change within a second. Output is a table, or JSON
with `--json`. The signed-key commands, `zerohop keys sign` and `keygen`, are
`zerohop.cli.keys_signed`.

Every value is checked as argparse reads it (`keys_args`, `validation`): a negative limit,
a weight <= 0, a budget <= 0 is a one-line usage error naming the flag (exit 2). A row the
store holds with an invalid value (an older version's, or one written by hand) is listed as
"invalid"; `update` and `tenant` repair it, and refuse (exit 1) to write such a row back
without a new value for each invalid field, which would otherwise become a placeholder.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from zerohop.cli.arg_types import Subcommands
from zerohop.cli.keys_args import (
    BUDGET_HELP,
    NO_BUDGET,
    add_limit_flags,
    argtype,
    parse_budget_or_none,
    parse_duration_or_time,
    parse_weight,
)
from zerohop.gateway.budgets.sqlite_ledger import period_key
from zerohop.gateway.keys.identity import (
    LIMIT_FIELDS,
    LIMIT_NAMES,
    PRIORITY_CLASSES,
    Limits,
    Tenant,
)
from zerohop.gateway.store.open_store import Database, StoreSpec, open_database
from zerohop.gateway.store.rows import Problems
from zerohop.gateway.store.spec import STORE_ENV, store_text
from zerohop.gateway.store.sqlite import KeyRecord, default_db_path

# The flag that sets each column of a store row (to name it when a row must be repaired).
_FLAG_OF_COLUMN = {f.name: f.flag for f in LIMIT_FIELDS} | {
    "budget_tokens": "budget",
    "budget_period": "budget",
    "weight": "weight",
    "priority": "priority",
    "models": "models",
    "expires": "expires",
    "name": "name",
    "tenant": "tenant",
}


# One `zerohop keys` action on the store it opened.
KeysCommand = Callable[[Database, argparse.Namespace], int]


def add_keys_parser(sub: Subcommands) -> None:
    keys = sub.add_parser("keys", help="manage API keys, tenants and their limits and budgets")
    actions = keys.add_subparsers(dest="keys_command", required=True)

    create = _action(actions, "create", "create a key (its secret is shown once)", _create)
    create.add_argument("--tenant", required=True, help="the tenant the key belongs to")
    create.add_argument("--name", default="", help="a label for people")
    create.add_argument(
        "--admin", action="store_true",
        help="an admin key: the admin API and /console; not the model unless --inference",
    )  # fmt: skip
    create.add_argument(
        "--inference", action="store_true", help="with --admin: may call the model too"
    )
    _key_options(create)

    update = _action(actions, "update", "change a key's tenant, limits, budget, models...", _update)
    update.add_argument("key_id")
    update.add_argument("--tenant")
    update.add_argument("--name")
    _key_options(update)

    _action(actions, "list", "list keys", _list).add_argument("--tenant")
    _action(actions, "show", "show one key", _show).add_argument("key_id")
    _action(
        actions, "revoke", "revoke a key (the server refuses it within 1 s)", _revoke
    ).add_argument("key_id")
    tenant = _action(actions, "tenant", "set a tenant's limits, budget and weight", _tenant)
    tenant.add_argument("name")
    tenant.add_argument(
        "--weight", type=argtype(parse_weight), help="fair-share weight, > 0 (default 1)"
    )
    _limit_options(tenant)
    _action(actions, "usage", "token spend per key and tenant, per budget period", _usage)

    from zerohop.cli.keys_signed import (
        add_keygen_arguments,
        add_sign_arguments,
        cmd_keygen,
        cmd_sign,
    )

    sign = actions.add_parser("sign", help="mint a signed key (JWT) for --jwt-public-key servers")
    add_sign_arguments(sign)
    sign.set_defaults(func=cmd_sign)
    keygen = actions.add_parser("keygen", help="make a key pair for signed keys")
    add_keygen_arguments(keygen)
    keygen.set_defaults(func=cmd_keygen)


def _action(
    actions: Subcommands, name: str, help_text: str, func: KeysCommand
) -> argparse.ArgumentParser:
    parser = actions.add_parser(name, help=help_text)
    parser.add_argument(
        "--keys-db", type=Path, default=None, help=f"the key store (default {default_db_path()})"
    )
    parser.add_argument(
        "--store", help=f"a fleet's key store, postgresql://... (default ${STORE_ENV})"
    )
    parser.add_argument("--json", action="store_true", help="JSON output, for scripts")
    parser.set_defaults(func=lambda args: _run(func, args))
    return parser


def _limit_options(parser: argparse.ArgumentParser) -> None:
    add_limit_flags(
        parser, budget=argtype(parse_budget_or_none), budget_help=BUDGET_HELP + "; none: no budget"
    )


def _key_options(parser: argparse.ArgumentParser) -> None:
    _limit_options(parser)
    parser.add_argument("--models", help="comma-separated models the key may use (default: all)")
    parser.add_argument("--expires", help="a duration (30d, 12h) or an ISO-8601 time")
    parser.add_argument("--priority", choices=PRIORITY_CLASSES, help="priority class")


def _run(func: KeysCommand, args: argparse.Namespace) -> int:
    if args.keys_db is not None and args.store is not None:
        print("zerohop keys: --keys-db and --store name two stores: give one", file=sys.stderr)
        return 2
    store = open_database(_spec(args))
    try:
        return func(store, args)
    except (KeyError, ValueError) as exc:
        print(f"zerohop keys: {exc}", file=sys.stderr)
        return 1
    finally:
        store.close()


def _spec(args: argparse.Namespace) -> StoreSpec:
    """--keys-db, else --store, else $ZEROHOP_STORE, else the default SQLite file."""
    if args.keys_db is not None:
        return StoreSpec.sqlite(args.keys_db)
    text = store_text(args.store)
    return StoreSpec.parse(text) if text else StoreSpec.sqlite(default_db_path())


# -- actions ------------------------------------------------------------------------------------


def _create(store: Database, args: argparse.Namespace) -> int:
    fields = _key_fields(args)
    fields.setdefault("limits", Limits())
    if args.inference and not args.admin:
        raise ValueError("--inference goes with --admin (a key calls the model by default)")
    admin = {"admin": True, "inference": args.inference} if args.admin else {}
    secret, record = store.create_key(args.tenant, name=args.name, **fields, **admin)
    if args.json:
        print(json.dumps({"key": secret, **record.as_dict()}, indent=2))
    else:
        print(f"key: {secret}")
        print("  (shown once: it is stored only as a hash)")
        _print_keys([record])
    return 0


def _update(store: Database, args: argparse.Namespace) -> int:
    fields = _key_fields(args)
    if args.tenant is not None:
        fields["tenant"] = args.tenant
    if args.name is not None:
        fields["name"] = args.name
    if "limits" in fields:  # flags given replace those limits; the others stay
        old = store.key(args.key_id)
        if old is None:
            raise KeyError(f"no key {args.key_id}")
        limit_problems = {
            k: v for k, v in old.problems.items() if k.partition(".")[2] in LIMIT_NAMES
        }
        _check_repaired(f"key {args.key_id}", limit_problems, args)
        fields["limits"] = _merge_limits(old.limits, args)
    record = store.update_key(args.key_id, **fields)
    _output([record], args.json)
    return 0


def _list(store: Database, args: argparse.Namespace) -> int:
    records = [r for r in store.list_keys() if args.tenant in (None, r.tenant)]
    _output(records, args.json)
    return 0


def _show(store: Database, args: argparse.Namespace) -> int:
    record = store.key(args.key_id)
    if record is None:
        raise KeyError(f"no key {args.key_id}")
    _output([record], args.json)
    return 0


def _revoke(store: Database, args: argparse.Namespace) -> int:
    if store.key(args.key_id) is None:
        raise KeyError(f"no key {args.key_id}")
    done = store.revoke_key(args.key_id)
    print(f"{args.key_id}: {'revoked' if done else 'was already revoked'}")
    return 0


def _tenant(store: Database, args: argparse.Namespace) -> int:
    row = store.tenant_row(args.name)
    if row is not None:  # every column is written back: no placeholder may be
        _check_repaired(f"tenant {args.name}", row.problems, args)
    old = Tenant(args.name) if row is None else row.tenant
    budget = _budget(args.budget) if args.budget is not None else old.budget
    weight = args.weight if args.weight is not None else old.weight
    tenant = Tenant(args.name, _merge_limits(old.limits, args), budget, weight)
    store.upsert_tenant(tenant)
    shown: dict[str, Any] = {
        "tenant": tenant.name,
        "weight": tenant.weight,
        **{k: getattr(tenant.limits, k) for k in LIMIT_NAMES},
        "budget": _budget_text(tenant.budget),
    }
    if args.json:
        print(json.dumps(shown, indent=2))
    else:
        _print_table([shown])
    return 0


def _usage(store: Database, args: argparse.Namespace) -> int:
    budgets = {f"key:{r.key_id}": r.budget for r in store.list_keys()}
    budgets |= {f"tenant:{t.name}": t.budget for t in store.tenants()}
    rows = []
    for subject, period, tokens in store.spend():
        budget = budgets.get(subject)
        limit = (
            budget.tokens if budget is not None and period == period_key(budget.period) else None
        )
        rows.append(
            {
                "subject": subject,
                "period": period,
                "tokens": tokens,
                "budget": limit,
                "remaining": None if limit is None else limit - tokens,
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
    elif rows:
        _print_table(rows)
    else:
        print("no token spend recorded yet (only keys and tenants with a budget are metered)")
    return 0


# -- helpers ------------------------------------------------------------------------------------


def _key_fields(args: argparse.Namespace) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if any(getattr(args, k) is not None for k in LIMIT_NAMES):
        fields["limits"] = Limits(**{k: getattr(args, k) for k in LIMIT_NAMES})
    if args.budget is not None:
        fields["budget"] = _budget(args.budget)
    if args.models is not None:
        fields["models"] = [m.strip() for m in args.models.split(",") if m.strip()]
    if args.expires is not None:
        fields["expires"] = parse_duration_or_time(args.expires)
    if args.priority is not None:
        fields["priority"] = args.priority
    return fields


def _merge_limits(old: Limits, args: argparse.Namespace) -> Limits:
    values = {
        k: getattr(args, k) if getattr(args, k) is not None else getattr(old, k)
        for k in LIMIT_NAMES
    }
    return Limits(**values)


def _budget(value: Any) -> Any:
    return None if value == NO_BUDGET else value


def _check_repaired(what: str, problems: Problems, args: argparse.Namespace) -> None:
    """ValueError unless the command sets a new value for every invalid field of the row."""
    missing = {}
    for column, message in problems.items():
        flag = _FLAG_OF_COLUMN.get(column.partition(".")[2], "")
        if getattr(args, flag.replace("-", "_"), None) is None:
            missing[f"--{flag}"] = message
    if missing:
        raise ValueError(
            f"{what} has invalid stored values ({'; '.join(missing.values())}):"
            f" give {', '.join(sorted(missing))} too"
        )


def _budget_text(budget: Any) -> str:
    if budget is None:
        return "-"
    return f"{budget.tokens}/{budget.period}" if budget.period != "total" else str(budget.tokens)


def _output(records: list[KeyRecord], as_json: bool) -> None:
    if as_json:
        print(json.dumps([r.as_dict() for r in records], indent=2))
    else:
        _print_keys(records)


def _print_keys(records: list[KeyRecord]) -> None:
    now = time.time()
    rows = []
    for r in records:
        state = (
            "revoked" if r.revoked else ("expired" if r.expires and r.expires <= now else "active")
        )
        if r.problems:
            state = "invalid: " + ", ".join(r.problems)
        elif r.admin:
            state += " (admin+model)" if r.inference else " (admin)"
        rows.append(
            {
                "key_id": r.key_id,
                "tenant": r.tenant,
                "name": r.name,
                "state": state,
                **{k: getattr(r.limits, k) for k in LIMIT_NAMES},
                "budget": _budget_text(r.budget),
                "models": ",".join(r.models) or "*",
                "expires": _time(r.expires),
            }
        )
    if rows:
        _print_table(rows)
    else:
        print("no keys")


def _time(value: float | None) -> str:
    if value is None:
        return "-"
    return datetime.fromtimestamp(value, UTC).strftime("%Y-%m-%d %H:%M")


def _print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for column in rows[0]:
        table.add_column(column.replace("_", " "))
    for row in rows:
        table.add_row(*("-" if v is None else str(v) for v in row.values()))
    # Piped output is not cut to 80 columns: scripts and logs get whole key ids.
    Console(width=None if sys.stdout.isatty() else 240).print(table)
