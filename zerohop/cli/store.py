"""`zerohop store`: the fleet's PostgreSQL key store: `migrate` it to this zerohop's schema,
show its `status` (schema, keys, live replicas, active budget leases).

The store is `--store URL`, by default $ZEROHOP_STORE, which is where a password belongs
(never on a command line, where `ps` shows it). `migrate` with neither set does nothing and
succeeds, so a deployment's init container may run it whether or not a store is configured.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from zerohop.cli.arg_types import Subcommands
from zerohop.gateway.store.pg_schema import SCHEMA_VERSION
from zerohop.gateway.store.spec import STORE_ENV, StoreSpec, StoreUnavailable, store_text

# psycopg takes ~0.3 s to import: only the `store` commands do.

_STATUS = {
    "keys": "SELECT count(*) FROM keys",
    "active_keys": "SELECT count(*) FROM keys WHERE revoked IS NULL"
    " AND (expires IS NULL OR expires > extract(epoch FROM now()))",
    "tenants": "SELECT count(*) FROM tenants",
    "keys_version": "SELECT value FROM store_meta WHERE name = 'keys_version'",
    "live_replicas": "SELECT count(*) FROM replicas WHERE expires_at > now()",
    "active_leases": "SELECT count(*) FROM leases WHERE state = 'active'",
}


def add_store_parser(sub: Subcommands) -> None:
    store = sub.add_parser("store", help="the fleet's PostgreSQL key store: migrate, status")
    actions = store.add_subparsers(dest="store_command", required=True)
    for name, help_text, func in (
        ("migrate", "bring the store's schema to this zerohop's (safe to run again)", _migrate),
        ("status", "schema version, keys, tenants, live replicas, active leases", _status),
    ):
        action = actions.add_parser(name, help=help_text)
        action.add_argument(
            "--store", help=f"postgresql://... URL (default ${STORE_ENV}; keep passwords there)"
        )
        action.add_argument("--json", action="store_true", help="JSON output, for scripts")
        action.set_defaults(func=func)


def _spec(args: argparse.Namespace) -> StoreSpec | None:
    text = store_text(args.store)
    return None if text is None else StoreSpec.parse(text)


def _migrate(args: argparse.Namespace) -> int:
    spec = _spec(args)
    if spec is None or spec.kind != "postgresql":
        what = f"no --store and no ${STORE_ENV}" if spec is None else f"{spec.describe()} is SQLite"
        _say(args, f"{what}: no PostgreSQL store to migrate", {"store": None, "applied": []})
        return 0
    from zerohop.gateway.store.pg_migrations import describe, migrate

    result = migrate(spec.url)
    out = {"store": spec.describe(), "applied": result.applied, "version": result.version}
    _say(args, f"{spec.describe()}: {describe(result)}", out)
    return 0


def _status(args: argparse.Namespace) -> int:
    spec = _spec(args)
    if spec is None or spec.kind != "postgresql":
        print(f"zerohop store: give --store postgresql://... or set ${STORE_ENV}", file=sys.stderr)
        return 2
    import psycopg

    from zerohop.gateway.store.postgres import MIGRATE_HINT, connect

    try:
        with connect(spec.url) as conn:
            status = {"store": spec.describe(), **_read_status(conn)}
    except psycopg.OperationalError as exc:
        raise StoreUnavailable.wrap(exc, spec.url) from exc
    if status["schema_version"] == 0:
        where = spec.describe()
        print(f"zerohop store: {where} has no zerohop schema: {MIGRATE_HINT}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        for name, value in status.items():
            print(f"{name.replace('_', ' ')}: {value}")
    return 0


def _read_status(conn: Any) -> dict[str, Any]:
    from zerohop.gateway.store.pg_migrations import schema_version

    version = schema_version(conn)
    status: dict[str, Any] = {"schema_version": version, "this_zerohop": SCHEMA_VERSION}
    if version == 0:
        return status
    for name, sql in _STATUS.items():
        status[name] = conn.execute(sql).fetchone()[0]
    return status


def _say(args: argparse.Namespace, line: str, out: dict[str, Any]) -> None:
    print(json.dumps(out, indent=2) if args.json else line)
