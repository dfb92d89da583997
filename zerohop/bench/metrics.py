"""vLLM's serving metrics over a run's requests, goodput under SLOs, and the text report.

TTFT, TPOT, ITL and E2E as `vllm bench serve` defines them (see `zerohop.bench.load`);
percentiles by numpy's linear interpolation, as vLLM. Goodput counts the requests per second
that met every SLO given (`ttft=500ms,tpot=50ms,e2el=4s`), as vLLM's `--goodput`.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zerohop.bench.load_types import BenchConfig, RequestResult

PERCENTILES = (50, 90, 95, 99)
SLO_METRICS = ("ttft", "tpot", "itl", "e2el")
CLIENT_BUSY_WARNING = 0.8  # of one core: the client's event loop may be the bottleneck
_DURATION = re.compile(r"^(?P<value>[0-9.]+)\s*(?P<unit>ms|s)?$")


def parse_slo(text: str) -> dict[str, float]:
    """`ttft=500ms,tpot=50ms` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slo: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        match = _DURATION.match(value.strip())
        if name not in SLO_METRICS or match is None:
            raise ValueError(f"SLO {part!r}: want NAME=VALUE[ms|s], NAME one of {SLO_METRICS}")
        factor = 1000.0 if match["unit"] == "s" else 1.0
        slo[name] = float(match["value"]) * factor
    return slo


def distribution_ms(values_s: Sequence[float]) -> dict[str, float] | None:
    """mean, std, median and percentiles (numpy's linear interpolation, as vLLM) in ms."""
    if not values_s:
        return None
    import numpy as np

    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    out = {"mean": float(ms.mean()), "std": float(ms.std())}
    out |= {f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}
    return out | {"min": float(ms.min()), "max": float(ms.max()), "count": int(ms.size)}


def tpot(r: RequestResult) -> float | None:
    return (r.e2e - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else None


def meets(r: RequestResult, slo: dict[str, float]) -> bool:
    """Whether a completed request met every SLO (ms); ITL: its every gap."""
    measured = {
        "ttft": r.ttft * 1000,
        "tpot": (tpot(r) or 0.0) * 1000,
        "itl": max(r.itl, default=0.0) * 1000,
        "e2el": r.e2e * 1000,
    }
    return all(measured[name] <= limit for name, limit in slo.items())


def error_kind(error: str) -> str:
    """`HTTP 529: {...}` -> `HTTP 529`; `ClientConnectorError: ...` -> its class name."""
    head = error.split(":", 1)[0]
    return head if len(head) < 40 else "other"


def summarize(
    results: Sequence[RequestResult],
    duration: float,
    cfg: BenchConfig,
    client_cpu_s: float | None = None,
) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    total_in = sum(r.prompt_tokens for r in done)
    total_out = sum(r.output_tokens for r in done)
    errors = sorted({r.error for r in results if r.error})
    slo = cfg.slo or {}
    summary = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "max_concurrency": cfg.concurrency,
        "request_rate": cfg.request_rate,
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "total_token_events": sum(r.events for r in done),
        "request_throughput": len(done) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "ttft_ms": distribution_ms([r.ttft for r in done]),
        "tpot_ms": distribution_ms([t for r in done if (t := tpot(r)) is not None]),
        "itl_ms": distribution_ms([x for r in done for x in r.itl]),
        "e2el_ms": distribution_ms([r.e2e for r in done]),
        "slo_ms": slo or None,
        "goodput": sum(meets(r, slo) for r in done) / duration if slo else None,
        "errors_by_type": dict(Counter(error_kind(r.error) for r in results if r.error)),
        "client_busy_cores": None if client_cpu_s is None else client_cpu_s / duration,
        "checks": {
            "all_completed": len(done) == len(results),
            "output_tokens_as_requested": all(r.output_tokens == cfg.output_tokens for r in done)
            if not (cfg.dataset or cfg.range_ratio)
            else None,
            # Only completions and gRPC send token ids; chat and messages prompts are text.
            "prompt_tokens_as_requested": all(r.prompt_tokens == cfg.input_tokens for r in done)
            if cfg.endpoint in ("openai-completions", "grpc")
            and not (cfg.dataset or cfg.range_ratio)
            else None,
            "one_event_per_token": all(r.events == r.output_tokens for r in done),
        },
        "errors": errors[:5],
    }
    return summary


def client_warning(summary: dict[str, Any]) -> str | None:
    busy = summary.get("client_busy_cores")
    if busy is None or busy < CLIENT_BUSY_WARNING:
        return None
    return (
        f"warning: the load client used {busy:.2f} of a core: its event loop may be the"
        " bottleneck, so latencies include client time (run fewer streams per client)"
    )


def format_report(report: dict[str, Any]) -> str:
    """vLLM-style text summary."""
    s, c = report["summary"], report["config"]
    rate = "inf (closed loop)" if s.get("request_rate") is None else f"{s['request_rate']:g}"
    lines = [
        f"{' Serving Benchmark Result ':=^56}",
        f"{'Endpoint:':<40}{c['endpoint']:>16}",
        f"{'Request rate (req/s):':<40}{rate:>16}",
        f"{'Maximum request concurrency:':<40}{s['max_concurrency']:>16}",
        f"{'Successful requests:':<40}{s['completed']:>16}",
        f"{'Failed requests:':<40}{s['failed']:>16}",
        f"{'Benchmark duration (s):':<40}{s['duration_s']:>16.2f}",
        f"{'Total input tokens:':<40}{s['total_input_tokens']:>16}",
        f"{'Total generated tokens:':<40}{s['total_output_tokens']:>16}",
        f"{'Request throughput (req/s):':<40}{s['request_throughput']:>16.2f}",
        f"{'Output token throughput (tok/s):':<40}{s['output_throughput']:>16.2f}",
        f"{'Total token throughput (tok/s):':<40}{s['total_token_throughput']:>16.2f}",
    ]
    if s.get("goodput") is not None:
        lines.append(f"{'Request goodput (req/s):':<40}{s['goodput']:>16.2f}")
    titles = {
        "ttft_ms": "Time to First Token",
        "tpot_ms": "Time per Output Token (excl. 1st token)",
        "itl_ms": "Inter-token Latency",
        "e2el_ms": "End-to-end Latency",
    }
    for key, title in titles.items():
        lines.append(f"{' ' + title + ' ':-^56}")
        d = s[key]
        if d is None:
            lines.append(f"{'(no samples)':<40}")
            continue
        name = key.removesuffix("_ms").upper()
        for stat in ("mean", "p50", "p90", "p95", "p99"):
            lines.append(f"{f'{stat.capitalize()} {name} (ms):':<40}{d[stat]:>16.2f}")
    failed_checks = [k for k, ok in s["checks"].items() if ok is False]
    if failed_checks:
        lines.append(f"{'Checks not met:':<40}{', '.join(failed_checks)}")
    for kind, count in (s.get("errors_by_type") or {}).items():
        lines.append(f"{f'Errors, {kind}:':<40}{count:>16}")
    lines.extend(f"error: {e}" for e in s["errors"])
    if warning := client_warning(s):
        lines.append(warning)
    lines.append("=" * 56)
    return "\n".join(lines)
