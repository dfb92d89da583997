"""`zerohop` command line: serve, bench, probe, keys, store, audit and generate.

- `serve`: serve a model over HTTP (the Anthropic and OpenAI APIs on one port: HTTP/1.1,
  h2c, TLS+ALPN h2) and gRPC, with the gateway built in (API keys, limits, budgets, audit,
  metrics) and the connection protection a reverse proxy used to give (`zerohop.cli.serve`,
  its engine flags in `zerohop.cli.engine_flags`);
- `bench`: benchmark a running server (`zerohop.cli.bench`);
- `probe`: time one streamed request and find buffering on the way (`zerohop.cli.probe`);
- `keys`: manage API keys, tenants, their limits and budgets, and signed keys
  (`zerohop.cli.keys`);
- `store`: migrate a fleet's PostgreSQL key store, show its status (`zerohop.cli.store`);
- `audit`: check an audit log's hash chain and recorded head (`zerohop.cli.audit`);
- `generate`: generate text offline from one prompt, with the engine in this process
  (`zerohop.cli.generate`).

The top but one of the import graph: may import app, bench, api, gateway, engine and models;
only the root's __main__ imports it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from zerohop.cli.arg_types import OneLineParser
from zerohop.cli.engine_flags import default_engine_threads as default_engine_threads
from zerohop.cli.engine_flags import engine_options as engine_options  # re-exported
from zerohop.cli.generate import add_generate_parser
from zerohop.cli.serve import add_serve_parser


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="zerohop", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    __import__("zerohop.cli.bench", fromlist=["add_bench_parser"]).add_bench_parser(sub)
    from zerohop.cli.probe import add_probe_parser

    add_probe_parser(sub)
    from zerohop.cli.audit import add_audit_parser
    from zerohop.cli.keys import add_keys_parser
    from zerohop.cli.store import add_store_parser

    add_keys_parser(sub)
    add_store_parser(sub)
    add_audit_parser(sub)
    add_generate_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from zerohop.cli.errors import failure_line

    args = build_parser().parse_args(argv)
    command: Callable[[argparse.Namespace], int] = args.func  # argparse's Namespace: untyped
    try:
        return command(args)
    except Exception as exc:  # a refusal or an outside failure: one line (cli_errors)
        line = failure_line(exc, getattr(args, "keys_db", None))
        if line is None:
            raise
        print(f"zerohop: {line}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
