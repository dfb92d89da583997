"""`zerohop keys sign` and `zerohop keys keygen`: signed keys (wired by `keys_cli`).

`keygen` writes an operator key pair (private PEM 0600, public PEM, optionally a JWKS) for
`zerohop serve --jwt-public-key`; `sign` prints one signed key (a JWT) whose claims carry the
key's tenant, models, priority, limits and budgets (`zerohop.gateway.keys.signed_claims`).
`sign` needs `--expires`, or `--no-expiry` for a key that never expires (which servers
accept only with `--allow-nonexpiring-signed-keys`; only revocation ends such a key).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from zerohop.cli.keys_args import (
    add_limit_flags,
    argtype,
    parse_duration_or_time,
    parse_weight,
)
from zerohop.gateway.keys.identity import LIMIT_NAMES, PRIORITY_CLASSES, Identity, Limits, Tenant
from zerohop.gateway.keys.operator_keys import DEFAULT_AUDIENCE, generate_keypair, public_jwk, sign
from zerohop.gateway.keys.signed_claims import claims_from_identity, iso_time


def add_sign_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `zerohop keys sign` (prints one signed key on stdout)."""
    p = parser
    p.add_argument("--private-key", required=True, metavar="FILE", help="PEM private key")
    p.add_argument("--key-id", required=True, metavar="ID", help="the key id (claim sub)")
    p.add_argument("--tenant", required=True, help="the tenant's name")
    p.add_argument("--name", default="", help="a label for the key")
    p.add_argument("--models", default="", metavar="A,B", help="allowed models (default: all)")
    p.add_argument("--priority", choices=PRIORITY_CLASSES, default="interactive")
    p.add_argument("--admin", action="store_true", help="an admin key (claim admin)")
    p.add_argument("--inference", action="store_true", help="with --admin: may call the model")
    for prefix, whose in (("", "the key"), ("tenant-", "the whole tenant")):
        add_limit_flags(p.add_argument_group(f"limits of {whose}"), prefix=prefix)
    p.add_argument(
        "--tenant-weight", type=argtype(parse_weight), default=1.0, help="fair-share weight"
    )
    when = argtype(parse_duration_or_time)
    expiry = p.add_mutually_exclusive_group(required=True)
    expiry.add_argument(
        "--expires", type=when, metavar="WHEN", help="30d, 12h, or an ISO-8601 time (UTC)"
    )
    expiry.add_argument(
        "--no-expiry",
        action="store_true",
        help="a key that never expires (only revocation ends it); servers accept it only"
        " with --allow-nonexpiring-signed-keys",
    )
    p.add_argument("--not-before", type=when, metavar="WHEN", help="like --expires")
    p.add_argument("--audience", default=DEFAULT_AUDIENCE, help="claim aud (%(default)s)")
    p.add_argument("--jti", default=None, help="the token's id (default: random)")
    p.add_argument("--kid", default=None, help="header kid: the signing key's id in a JWKS")


def _limits_args(args: argparse.Namespace, prefix: str) -> Limits:
    return Limits(**{f: getattr(args, prefix + f) for f in LIMIT_NAMES})


def cmd_sign(args: argparse.Namespace) -> int:
    """`zerohop keys sign`: print one signed key (a JWT) on stdout."""
    try:
        private_pem = Path(args.private_key).read_bytes()
    except OSError as e:
        print(f"zerohop keys sign: {args.private_key}: {e.strerror}", file=sys.stderr)
        return 1
    now = time.time()
    identity = Identity(
        key_id=args.key_id,
        tenant=Tenant(
            args.tenant,
            limits=_limits_args(args, "tenant_"),
            budget=args.tenant_budget,
            weight=args.tenant_weight,
        ),
        name=args.name,
        models=tuple(m.strip() for m in args.models.split(",") if m.strip()),
        priority=args.priority,
        limits=_limits_args(args, ""),
        budget=args.budget,
        expires_at=args.expires,
        admin=args.admin,
        inference=args.inference or not args.admin,
    )
    claims = claims_from_identity(identity)
    if args.expires is not None and args.expires <= now:
        print(f"zerohop keys sign: --expires {iso_time(args.expires)} is past", file=sys.stderr)
        return 2
    if args.not_before is not None:
        claims["nbf"] = int(args.not_before)
    if args.jti:
        claims["jti"] = args.jti
    try:
        token = sign(
            private_pem, claims, expires_in=None, audience=args.audience, kid=args.kid, now=now
        )
    except ValueError as e:
        print(f"zerohop keys sign: {e}", file=sys.stderr)
        return 1
    if args.expires is None:
        print(
            f"zerohop keys sign: this key never expires; servers accept it only with"
            f" --allow-nonexpiring-signed-keys; revoke it by listing {args.key_id!r}"
            " in the --revoked file",
            file=sys.stderr,
        )
    print(token)
    return 0


def add_keygen_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `zerohop keys keygen` (writes a signing key pair)."""
    p = parser
    p.add_argument("--out-private", required=True, metavar="FILE", help="PEM private key (0600)")
    p.add_argument("--out-public", required=True, metavar="FILE", help="PEM public key")
    p.add_argument("--kind", choices=("ed25519", "es256"), default="ed25519")
    p.add_argument("--out-jwks", metavar="FILE", help="also write the public key as a JWKS")
    p.add_argument("--kid", default=None, help="kid of the key in the JWKS")
    p.add_argument("--force", action="store_true", help="overwrite existing files")


def _write(path: str, data: bytes, mode: int, force: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    fd = os.open(path, flags, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def cmd_keygen(args: argparse.Namespace) -> int:
    """`zerohop keys keygen`: write a new private (0600) and public key, PEM (+ JWKS)."""
    private_pem, public_pem = generate_keypair(args.kind)
    outputs = [(args.out_private, private_pem, 0o600), (args.out_public, public_pem, 0o644)]
    if args.out_jwks:
        jwks = {"keys": [public_jwk(public_pem, args.kid)]}
        outputs.append((args.out_jwks, (json.dumps(jwks, indent=2) + "\n").encode(), 0o644))
    if not args.force:
        existing = [path for path, _, _ in outputs if os.path.exists(path)]
        if existing:
            print(
                f"zerohop keys keygen: {', '.join(existing)} exists (--force overwrites)",
                file=sys.stderr,
            )
            return 1
    try:
        for path, data, mode in outputs:
            _write(path, data, mode, args.force)
    except OSError as e:
        print(f"zerohop keys keygen: {e.filename}: {e.strerror}", file=sys.stderr)
        return 1
    public = args.out_jwks or args.out_public
    print(
        f"wrote {args.kind} private key {args.out_private} (keep it secret; it signs keys"
        f" with `zerohop keys sign`) and public key {args.out_public}"
        + (f" and JWKS {args.out_jwks}" if args.out_jwks else "")
        + f"; serve with --jwt-public-key {public}"
    )
    return 0
