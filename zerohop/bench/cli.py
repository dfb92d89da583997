"""`zerohop bench`: drive a running server with concurrent streaming requests."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from zerohop.bench import ENDPOINTS


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark a running server (TTFT, TPOT, ITL, E2E, throughput)",
        description=(
            "Closed-loop load: CONCURRENCY streams send NUM_REQUESTS streaming requests with "
            "random prompts of INPUT_TOKENS token ids and MAX_TOKENS=OUTPUT_TOKENS; metrics "
            "as `vllm bench serve` defines them."
        ),
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--endpoint", choices=ENDPOINTS, default="openai-completions")
    p.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    p.add_argument("--concurrency", type=int, default=1, help="streams in flight")
    p.add_argument("--input-tokens", type=int, default=128, help="prompt length in tokens")
    p.add_argument("--output-tokens", type=int, default=64, help="max_tokens of each request")
    p.add_argument("--num-requests", type=int, default=32, help="requests measured")
    p.add_argument(
        "--shared-prefix-tokens",
        type=int,
        default=0,
        help="tokens every prompt starts with (0: distinct prompts, no prefix cache hits)",
    )
    p.add_argument(
        "--vocab-size", type=int, default=512, help="prompt token ids are drawn from [4, N)"
    )
    p.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos: outputs may end before --output-tokens",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--logprobs",
        type=int,
        default=None,
        help="completions logprobs per token (with it, every token gets its own event)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--warmup-requests", type=int, default=1, help="unmeasured requests first")
    p.add_argument("--api-key", help="sent as Authorization: Bearer and x-api-key")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--out", type=Path, help="write the JSON report here")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from zerohop.bench.load import BenchConfig, format_report, run_benchmark

    cfg = BenchConfig(
        url=args.url,
        concurrency=args.concurrency,
        input_tokens=args.input_tokens,
        output_tokens=args.output_tokens,
        num_requests=args.num_requests,
        endpoint=args.endpoint,
        model=args.model,
        seed=args.seed,
        vocab_size=args.vocab_size,
        shared_prefix_tokens=args.shared_prefix_tokens,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        logprobs=args.logprobs,
        warmup_requests=args.warmup_requests,
        api_key=args.api_key,
        timeout_s=args.timeout,
    )
    report = run_benchmark(cfg)
    print(format_report(report))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0 if report["summary"]["failed"] == 0 else 1
