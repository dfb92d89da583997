"""`zerohop audit verify`: check an audit log's hash chain and its recorded chain head."""

from __future__ import annotations

import argparse
import sqlite3
import sys
from pathlib import Path

from zerohop.gateway.audit import verify
from zerohop.gateway.audit_heads import ChainHead, read_head
from zerohop.gateway.store import default_db_path

PROG = "zerohop audit verify"


def add_audit_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("audit", help="check an audit log", description="Audit log tools.")
    asub = p.add_subparsers(dest="audit_command", required=True)
    v = asub.add_parser(
        "verify",
        help="check the hash chain of an audit log directory",
        description=(
            "Check every record's prev (SHA-256 of the previous line) and seq, across rotated "
            "files in name order then audit.jsonl, and that the log still holds the chain "
            "head the server recorded in its key store (newest records deleted: truncated). "
            "Records written in the last second before a crash may be missing without a "
            "report: the head is recorded once a second. Exit 0: intact; 1: broken or "
            "truncated (the first broken record, or the missing head, is named); 2: DIR is "
            "not a directory or the key store cannot be read."
        ),
    )
    v.add_argument("directory", type=Path, metavar="DIR")
    v.add_argument(
        "--trust-first",
        action="store_true",
        help="accept the first record as the chain's start (older files were removed)",
    )
    v.add_argument(
        "--keys-db",
        type=Path,
        help="the key store the server recorded the chain head in (default: DIR/../keys.db"
        " if it has DIR's head, as `zerohop serve` lays them out, else"
        " $XDG_DATA_HOME/zerohop/keys.db)",
    )
    v.set_defaults(func=cmd_audit_verify)


def recorded_head(directory: Path, keys_db: Path | None) -> tuple[ChainHead | None, Path]:
    """The chain head recorded for `directory`, and the key store looked in (the last one)."""
    candidates = [keys_db] if keys_db else [directory.parent / "keys.db", default_db_path()]
    for db in candidates:
        head = read_head(db, directory)
        if head is not None:
            return head, db
    return None, candidates[-1]


def cmd_audit_verify(args: argparse.Namespace) -> int:
    if not args.directory.is_dir():
        print(f"{PROG}: {args.directory}: not a directory", file=sys.stderr)
        return 2
    try:
        head, db = recorded_head(args.directory, args.keys_db)
    except sqlite3.Error as exc:
        print(f"{PROG}: cannot read the chain head: {exc}", file=sys.stderr)
        return 2
    if head is None:
        print(
            f"note: no chain head recorded for {args.directory} in {db}:"
            " a deleted tail cannot be told",
            file=sys.stderr,
        )
    result = verify(args.directory, trust_first=args.trust_first, head=head)
    for where in result.torn:
        print(f"note: {where}: torn last line (a write cut by a crash), ignored")
    if result.first_broken is not None:
        print(f"broken: {result.first_broken}")
        return 1
    if result.truncated is not None:
        print(f"truncated: {result.truncated}")
        return 1
    print(f"ok: {result.records} records in {result.files} files")
    return 0
