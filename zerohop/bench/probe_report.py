"""`zerohop probe`'s output: a plain-text report, a JSON record and a PNG token timeline."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from zerohop.bench.probe import ProbeRun, RequestProbe
from zerohop.bench.probe_analysis import Spread, gaps

LABEL_WIDTH = 15
INDENT = "  "
ADDED_DELAY_NOTE = "added delay = receive - send - min(receive - send): cancels the clock offset"


def to_json(run: ProbeRun) -> dict[str, Any]:
    return asdict(run)


def format_report(run: ProbeRun) -> str:
    lines = [f"zerohop probe  {run.endpoint}  {run.url}  model {run.model}"]
    for probe in run.requests:
        lines += ["", *_request_lines(probe, len(run.requests))]
    return "\n".join(lines)


def _request_lines(probe: RequestProbe, count: int) -> list[str]:
    connection = "reused connection" if probe.reused_connection else "new connection"
    head = f"request {probe.index + 1} of {count}: {probe.status or '-'}  {probe.http_version}"
    head += f"  {connection} to {probe.remote_address or '?'}"
    if probe.tls_version:
        head += f"  {probe.tls_version}"
    usage = "" if probe.output_tokens is None else f" (usage: {probe.output_tokens} tokens)"
    lines = [
        head,
        _row("dns", _ms(probe.dns_s)),
        _row("tcp connect", _ms(probe.connect_s)),
        _row("tls", _ms(probe.tls_s)),
        _row("request sent", _ms(probe.request_sent_s)),
        _row("first byte", _ms(probe.ttfb_s) + "  (response headers)"),
        _row("first token", _ms(probe.ttft_s)),
        _row("total", f"{_ms(probe.total_s)}  {len(probe.token_received_s)} tokens{usage}"),
        _row("proxy headers", _headers(probe.proxy_headers)),
    ]
    if probe.error:
        lines.append(_row("error", probe.error))
    return lines + _timing_lines(probe)


def _timing_lines(probe: RequestProbe) -> list[str]:
    verdict = probe.buffering
    lines = []
    if verdict.stamps:
        lines.append(_row("stamps", f"{probe.stamped_events} server writes stamped"))
        lines.append(_row("", ADDED_DELAY_NOTE))
    if verdict.detected:
        lines.append(_row("buffering", "DETECTED"))
    else:
        lines.append(_row("buffering", "none seen" if verdict.detected is False else "unknown"))
    lines += [_row("", finding) for finding in verdict.findings]
    cv = "-" if verdict.gap_cv is None else f"{verdict.gap_cv:.2f}"
    lines.append(
        _row(
            "arrivals",
            f"gaps < 1 ms {verdict.sub_ms_gap_share:.0%}, max gap {_ms(verdict.max_gap_s)},"
            f" CV {cv}",
        )
    )
    columns = "".join(f"{name:>9}" for name in ("min", "p50", "p90", "p99", "max"))
    lines.append(f"{INDENT}{'':<{LABEL_WIDTH}}{columns}  (ms)")
    lines.append(_spread_row("gap received", probe.gaps_s))
    if probe.token_sent_s is not None:
        lines.append(_spread_row("gap sent", gaps(probe.token_sent_s)))
        lines.append(_spread_row("added delay", probe.added_delay_s or []))
    return lines


def _row(label: str, text: str) -> str:
    return f"{INDENT}{label:<{LABEL_WIDTH}}{text}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"


def _headers(headers: dict[str, str]) -> str:
    return ", ".join(f"{name}: {value}" for name, value in headers.items()) or "none"


def _spread_row(label: str, values: list[float]) -> str:
    spread = Spread.of(values)
    if spread is None:
        return _row(label, "-")
    cells = (spread.min, spread.p50, spread.p90, spread.p99, spread.max)
    return f"{INDENT}{label:<{LABEL_WIDTH}}" + "".join(f"{v * 1e3:>9.2f}" for v in cells)


def write_plot(run: ProbeRun, path: Path) -> None:
    """Token index against time since the request started: server send (aligned) and
    client receive, one pair of series per request, TTFB as a dotted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for probe in run.requests:
        tag = f"#{probe.index + 1}"
        indexes = range(len(probe.token_received_s))
        ms = [t * 1e3 for t in probe.token_received_s]
        line = ax.plot(indexes, ms, ".-", markersize=3, label=f"{tag} client receive")[0]
        if probe.token_sent_s is not None:
            sent = [t * 1e3 for t in probe.token_sent_s]
            label = f"{tag} server send (aligned)"
            ax.plot(indexes, sent, "x--", markersize=3, color=line.get_color(), label=label)
        if probe.ttfb_s is not None:
            ax.axhline(probe.ttfb_s * 1e3, color=line.get_color(), linestyle=":", linewidth=1)
    ax.set_xlabel("token index")
    ax.set_ylabel("ms since the request started")
    ax.set_title(f"{run.endpoint} {run.url} ({run.model})\ndotted: response headers received")
    ax.legend(loc="upper left", fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
