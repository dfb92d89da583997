"""`zerohop bench`: drive a running server with streaming requests; plot and compare runs."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerohop.bench import ENDPOINTS
from zerohop.cli.arg_types import Subcommands

if TYPE_CHECKING:
    from zerohop.bench.load_types import BenchConfig


def add_bench_parser(sub: Subcommands) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark a running server (TTFT, TPOT, ITL, E2E, throughput, goodput)",
        description=(
            "Streaming load on a running server, metrics as `vllm bench serve` defines them."
            " Closed loop (CONCURRENCY streams) by default; --request-rate sends at a rate"
            " instead (several rates: a latency-throughput curve). `zerohop bench compare"
            " A.json B.json` overlays saved runs in one figure."
        ),
    )
    p.add_argument("compare", nargs="*", help="`compare A.json B.json ...`: overlay saved runs")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--endpoint", choices=ENDPOINTS, default="openai-completions")
    p.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    p.add_argument(
        "--concurrency", type=int, default=None, help="streams in flight (rate mode: at most;"
        " default 1, or 1024 with --request-rate)",
    )  # fmt: skip
    p.add_argument(
        "--request-rate", help="requests per second, open loop (comma-separated: a sweep;"
        " `inf`: all at once)",
    )  # fmt: skip
    p.add_argument(
        "--burstiness", type=float, default=1.0,
        help="gamma shape of the gaps between sends: 1 Poisson, <1 burstier, >1 steadier",
    )  # fmt: skip
    p.add_argument("--duration", type=float, help="seconds to send for (and --num-requests)")
    p.add_argument("--input-tokens", type=int, default=128, help="prompt length in tokens")
    p.add_argument("--output-tokens", type=int, default=64, help="max_tokens of each request")
    p.add_argument("--num-requests", type=int, default=32, help="requests measured (at most)")
    p.add_argument(
        "--shared-prefix-tokens",
        type=int,
        default=0,
        help="tokens every prompt starts with (0: distinct prompts, no prefix cache hits)",
    )
    p.add_argument(
        "--prefix-groups", type=int, default=1,
        help="with --shared-prefix-tokens: this many distinct prefixes (groups of prompts)",
    )  # fmt: skip
    p.add_argument("--dataset", help="a ShareGPT-format JSON file: its prompts and reply lengths")
    p.add_argument(
        "--range-ratio", type=float, default=0.0,
        help="lengths uniform in L(1 +- R) for prompts and outputs (vLLM's random-range-ratio)",
    )  # fmt: skip
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
    p.add_argument("--slo", help="goodput SLOs, e.g. ttft=500ms,tpot=50ms (ttft|tpot|itl|e2el)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--warmup-requests", type=int, default=1, help="unmeasured requests first")
    p.add_argument("--api-key", help="sent as Authorization: Bearer and x-api-key")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--insecure", action="store_true", help="https: skip certificate checks")
    p.add_argument("--out", type=Path, help="write the JSON report here")
    p.add_argument("--plot", type=Path, help="write PNG plots with this path prefix")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no bar")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.compare:
        return cmd_compare(args)
    from zerohop.bench.metrics import format_report, parse_slo

    slo = parse_slo(args.slo) if args.slo else None
    rates = _rates(args.request_rate)
    reports = [run_one(args, rate, slo) for rate in rates]
    for report in reports:
        print(format_report(report))
    result: dict[str, Any] = reports[0] if len(reports) == 1 else {"runs": reports}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    if args.plot:
        for path in _plot(args.plot, {args.endpoint: reports}):
            print(f"wrote {path}")
    return 0 if all(r["summary"]["failed"] == 0 for r in reports) else 1


def run_one(
    args: argparse.Namespace, rate: float | None, slo: dict[str, float] | None
) -> dict[str, Any]:
    from zerohop.bench.load import run_benchmark
    from zerohop.bench.load_types import BenchConfig

    concurrency = args.concurrency or (1 if rate is None else 1024)
    cfg = BenchConfig(
        url=args.url,
        concurrency=concurrency,
        input_tokens=args.input_tokens,
        output_tokens=args.output_tokens,
        num_requests=args.num_requests,
        endpoint=args.endpoint,
        model=args.model,
        seed=args.seed,
        vocab_size=args.vocab_size,
        shared_prefix_tokens=args.shared_prefix_tokens,
        prefix_groups=args.prefix_groups,
        range_ratio=args.range_ratio,
        dataset=args.dataset,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        logprobs=args.logprobs,
        warmup_requests=args.warmup_requests,
        api_key=args.api_key,
        timeout_s=args.timeout,
        insecure=args.insecure,
        request_rate=rate,
        burstiness=args.burstiness,
        duration_s=args.duration,
        slo=slo,
    )
    if not args.progress:
        return run_benchmark(cfg)
    return _with_progress(cfg, run_benchmark)


def _with_progress(cfg: BenchConfig, run: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    label = "closed loop" if cfg.request_rate is None else f"{cfg.request_rate:g} req/s"
    columns = ("{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=True) as progress:
        task = progress.add_task(label, total=cfg.num_requests)
        return run(cfg, lambda _result: progress.advance(task))


def _rates(text: str | None) -> list[float | None]:
    if text is None:
        return [None]
    rates = [float(part) for part in text.split(",") if part.strip()]
    if not rates or any(r <= 0 for r in rates):
        raise SystemExit("--request-rate: positive numbers (or inf), comma-separated")
    return list[float | None](rates)


def cmd_compare(args: argparse.Namespace) -> int:
    if args.compare[0] != "compare" or len(args.compare) < 2:
        raise SystemExit("usage: zerohop bench compare A.json [B.json ...] [--plot PREFIX]")
    runs = {}
    for name in args.compare[1:]:
        runs[Path(name).stem] = _saved_runs(Path(name))
    from zerohop.bench.metrics import format_report

    for label, reports in runs.items():
        print(f"== {label}")
        for report in reports:
            print(format_report(report))
    for path in _plot(args.plot or Path("bench-compare"), runs):
        print(f"wrote {path}")
    return 0


def _saved_runs(path: Path) -> list[dict[str, Any]]:
    """The runs a `zerohop bench --out` file holds; ValueError naming the file if none."""
    try:
        saved = json.loads(path.read_text())
    except ValueError as exc:  # bad UTF-8 or JSON
        raise ValueError(f"{path}: not a saved bench run ({exc})") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{path}: not a saved bench run (no JSON object)")
    runs = saved.get("runs", [saved])
    if not isinstance(runs, list) or not all(isinstance(run, dict) for run in runs):
        raise ValueError(f"{path}: not a saved bench run (its runs are not JSON objects)")
    return runs


def _plot(prefix: Path, runs: dict[str, list[dict[str, Any]]]) -> list[Path]:
    """The CDFs of every run, and the rate curves where a label has a sweep."""
    from zerohop.bench.plots import latency_cdfs, rate_curves

    def label(name: str, report: dict[str, Any]) -> str:
        rate = report["summary"].get("request_rate")
        return name if rate is None else f"{name} @ {rate:g}/s"

    each = {label(n, r): r for n, reports in runs.items() for r in reports}
    paths = [latency_cdfs(each, prefix.with_name(prefix.name + "-latency-cdf.png"))]
    if any(len(reports) > 1 for reports in runs.values()):
        paths.append(rate_curves(runs, prefix.with_name(prefix.name + "-vs-rate.png")))
    return paths
