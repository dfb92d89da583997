"""`zerohop audit verify`: check audit logs' hash chains and their recorded chain heads."""

from __future__ import annotations

import argparse
import sqlite3
import sys
from pathlib import Path

from zerohop.cli.arg_types import Subcommands
from zerohop.gateway.audit.log import verify
from zerohop.gateway.store.audit_heads import ChainHead, only_head, read_head
from zerohop.gateway.store.sqlite import default_db_path

PROG = "zerohop audit verify"
# Where `zerohop serve` records the head, beside the audit folder: its --keys-db (with a
# PostgreSQL --store too, where that file is the replica's own).
BESIDE = "keys.db"


def add_audit_parser(sub: Subcommands) -> None:
    p = sub.add_parser("audit", help="check an audit log", description="Audit log tools.")
    asub = p.add_subparsers(dest="audit_command", required=True)
    v = asub.add_parser(
        "verify",
        help="check the hash chain of audit log directories",
        description=(
            "Check every record's prev (SHA-256 of the previous line) and seq, across rotated "
            "files in name order then audit.jsonl, and that the log still holds the chain head "
            "the server recorded in its key store (newest records deleted: truncated). Records "
            "written in the last second before a crash may be missing without a report: the head "
            "is recorded once a second. A folder moved or copied since (with its key store) is "
            "checked against the head the store beside it holds, if it holds only one. Several "
            "DIRs (a fleet's replicas' folders gathered in one place, each with its keys.db "
            "beside it) are each verified on their own, their output lines prefixed with 'DIR: '. "
            "Exit 0: intact; 1: broken or truncated (the first broken record, or the missing "
            "head, is named); 2: DIR is not a directory or the key store cannot be read; with "
            "several DIRs, the worst of theirs."
        ),
    )
    v.add_argument("directories", type=Path, nargs="+", metavar="DIR")
    v.add_argument(
        "--trust-first",
        action="store_true",
        help="accept the first record as the chain's start (older files were removed)",
    )
    v.add_argument(
        "--keys-db",
        type=Path,
        help="the key store the server recorded the chain head in; one DIR only (default:"
        " DIR/../keys.db if it has DIR's head, as `zerohop serve` lays them out, else"
        " $XDG_DATA_HOME/zerohop/keys.db)",
    )
    v.set_defaults(func=cmd_audit_verify)


def recorded_head(
    directory: Path, keys_db: Path | None
) -> tuple[ChainHead | None, Path, str | None]:
    """The chain head recorded for `directory`, the key store it was found in (else the last
    one looked in), and, when the folder was moved or copied since, where it was recorded."""
    beside = keys_db or directory.parent / BESIDE
    candidates = [keys_db] if keys_db else [beside, default_db_path()]
    for db in candidates:
        head = read_head(db, directory)
        if head is not None:
            return head, db, None
    if (only := only_head(beside)) is not None:  # gathered from elsewhere with its store
        return only[1], beside, only[0]
    return None, candidates[-1], None


def verify_directory(directory: Path, keys_db: Path | None, trust_first: bool, tag: str) -> int:
    """Verify one audit folder, every line it prints starting with `tag`; its exit code."""
    if not directory.is_dir():
        print(f"{PROG}: {directory}: not a directory", file=sys.stderr)
        return 2
    try:
        head, db, moved_from = recorded_head(directory, keys_db)
    except sqlite3.Error as exc:
        print(f"{PROG}: {tag}cannot read the chain head: {exc}", file=sys.stderr)
        return 2
    if head is None:
        print(
            f"{tag}note: no chain head recorded for {directory} in {db}:"
            " a deleted tail cannot be told",
            file=sys.stderr,
        )
    elif moved_from is not None:
        print(
            f"{tag}note: using the chain head {db} recorded for {moved_from}"
            " (the folder was moved or copied here)",
            file=sys.stderr,
        )
    result = verify(directory, trust_first=trust_first, head=head)
    for where in result.torn:
        print(f"{tag}note: {where}: torn last line (a write cut by a crash), ignored")
    if result.first_broken is not None:
        print(f"{tag}broken: {result.first_broken}")
        return 1
    if result.truncated is not None:
        print(f"{tag}truncated: {result.truncated}")
        return 1
    print(f"{tag}ok: {result.records} records in {result.files} files")
    return 0


def cmd_audit_verify(args: argparse.Namespace) -> int:
    directories: list[Path] = args.directories
    if args.keys_db is not None and len(directories) > 1:
        print(
            f"{PROG}: --keys-db is one directory's key store: give it with one DIR"
            " (several DIRs each use the keys.db beside them)",
            file=sys.stderr,
        )
        return 2
    several = len(directories) > 1
    worst = 0
    for directory in directories:
        tag = f"{directory}: " if several else ""
        worst = max(worst, verify_directory(directory, args.keys_db, args.trust_first, tag))
    return worst
