"""`zerohop probe URL`: time one streamed request phase by phase and look for buffering.

Only argparse here, so building the CLI parser stays cheap; the probe loads on use.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from zerohop.cli.arg_types import NONNEGATIVE_NUMBER, Subcommands

PROBE_ENDPOINTS = ("openai-chat", "openai-completions", "anthropic-messages")


def add_probe_parser(sub: Subcommands) -> None:
    p = sub.add_parser(
        "probe",
        help="time one streamed request (DNS, connect, TLS, TTFB, TTFT, gaps), find buffering",
        description=(
            "Send one streaming request (or --repeat N on one connection) and report where its"
            " latency comes from: DNS, TCP connect, TLS, first byte, first token, every gap"
            " between tokens, HTTP version, connection reuse, proxy response headers. It asks"
            " for the server's send-time stamps (zerohop-send-times: 1) and, where they come"
            " back, tells an intermediary that holds tokens back from the server's own pace."
        ),
    )
    p.add_argument("url", help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--endpoint", choices=PROBE_ENDPOINTS, default="openai-chat")
    p.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    p.add_argument("--prompt", help="the user message (or completion prompt)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--temperature",
        type=NONNEGATIVE_NUMBER,
        help="sampling temperature (default: the server's); 0 gives the same length every run",
    )
    p.add_argument("--api-key", help="sent as Authorization: Bearer and x-api-key")
    p.add_argument(
        "--http2", action="store_true", help="HTTP/2: ALPN on https, prior knowledge (h2c) on http"
    )
    p.add_argument("--repeat", type=int, default=1, help="requests, reusing the connection")
    p.add_argument("--json", action="store_true", help="print the whole record as JSON")
    p.add_argument("--plot", type=Path, metavar="PATH.png", help="write a token timeline PNG")
    p.add_argument("--insecure", action="store_true", help="do not verify the TLS certificate")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    p.set_defaults(func=cmd_probe)


def cmd_probe(args: argparse.Namespace) -> int:
    from zerohop.bench.probe import DEFAULT_PROMPT, ProbeConfig, ProbeError, run_probe
    from zerohop.bench.probe_report import format_report, to_json, write_plot

    config = ProbeConfig(
        url=args.url,
        endpoint=args.endpoint,
        model=args.model,
        prompt=args.prompt or DEFAULT_PROMPT,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        api_key=args.api_key,
        http2=args.http2,
        repeat=max(args.repeat, 1),
        insecure=args.insecure,
        timeout_s=args.timeout,
    )
    try:
        run = run_probe(config)
    except ProbeError as exc:
        print(f"zerohop probe: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(to_json(run), indent=2) if args.json else format_report(run))
    if args.plot:
        write_plot(run, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0 if all(probe.error is None for probe in run.requests) else 1
