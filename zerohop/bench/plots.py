"""PNG plots of `zerohop bench` reports (matplotlib, no display needed).

- `latency_cdfs`: TTFT and inter-token latency CDFs of one or more runs, overlaid.
- `rate_curves`: throughput, and TTFT / E2E percentiles, against the request rate of a sweep.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def pyplot() -> ModuleType:
    """matplotlib's pyplot, drawing to files only."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never a window
    import matplotlib.pyplot as plt

    return plt


def _cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    ordered = sorted(values)
    n = len(ordered)
    return ordered, [(i + 1) / n for i in range(n)]


def latency_cdfs(runs: Mapping[str, dict[str, Any]], path: Path) -> Path:
    """TTFT and ITL CDFs (ms), one line per run (label: the mapping's key)."""
    plt = pyplot()
    figure, (ttft_ax, itl_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, report in runs.items():
        rows = [r for r in report["requests"] if r["ok"]]
        if not rows:
            continue
        ttft_ax.plot(*_cdf([r["ttft"] * 1000 for r in rows]), label=label)
        gaps = [g * 1000 for r in rows for g in r["itl"]]
        if gaps:
            itl_ax.plot(*_cdf(gaps), label=label)
    for ax, title in ((ttft_ax, "time to first token"), (itl_ax, "inter-token latency")):
        ax.set(title=title, xlabel="ms", ylabel="fraction of samples", ylim=(0, 1.01))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save(figure, path)


def rate_curves(runs: Mapping[str, Sequence[dict[str, Any]]], path: Path) -> Path:
    """For each sweep (label -> reports at several rates): throughput and latency vs rate."""
    plt = pyplot()
    figure, (tput_ax, lat_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, reports in runs.items():
        points = sorted(
            (r["summary"] for r in reports if r["summary"]["request_rate"] is not None),
            key=lambda s: s["request_rate"],
        )
        if not points:
            continue
        rates = [s["request_rate"] for s in points]
        tput_ax.plot(rates, [s["output_throughput"] for s in points], "o-", label=label)
        for metric, style in (("ttft_ms", "o-"), ("e2el_ms", "s--")):
            for stat in ("p50", "p99"):
                values = [(s[metric] or {}).get(stat, float("nan")) for s in points]
                name = f"{label} {metric.removesuffix('_ms').upper()} {stat}"
                lat_ax.plot(rates, values, style, label=name, alpha=1 if stat == "p50" else 0.5)
    tput_ax.set(title="output throughput", xlabel="request rate (req/s)", ylabel="tokens/s")
    lat_ax.set(title="latency", xlabel="request rate (req/s)", ylabel="ms", yscale="log")
    for ax in (tput_ax, lat_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return save(figure, path)


def save(figure: Figure, path: Path) -> Path:
    """Lay out, write and close `figure`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot().close(figure)
    return path
