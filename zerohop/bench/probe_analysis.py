"""Token timing of one streamed response: gaps, delay added on the way, buffering verdict.

Server send times and client receive times come from two clocks. Each event's
`receive - send` is the network delay plus the offset between the clocks; subtracting the
smallest of those over the request cancels the offset and leaves the delay *added* on top
of the fastest event's. A buffer shows as events that left the server far apart and arrived
together (collapsed bursts), or as response headers that wait for the last token.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass, field

BURST_GAP_S = 0.001  # arrivals closer than this came out of the same read
COLLAPSED_SEND_SPAN_S = 0.010  # ...though the server sent them at least this far apart
COLLAPSED_SHARE = 0.25  # buffered: at least this share of tokens arrived in collapsed bursts
MIN_BURST = 3  # tokens in a burst worth calling one
COLLAPSE_RATIO = 0.1  # a burst arrived within this share of the time it took to send
NO_STAMPS = (
    "no send-time stamps came back (not a zerohop server, or something on the way dropped"
    " SSE comments): burstiness from arrival times only"
)


@dataclass(slots=True)
class Spread:
    """Percentiles of a list of durations, in seconds."""

    count: int
    min: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> Spread | None:
        if not values:
            return None
        ordered = sorted(values)
        return cls(
            len(ordered),
            ordered[0],
            percentile(ordered, 50),
            percentile(ordered, 90),
            percentile(ordered, 99),
            ordered[-1],
        )


def percentile(ordered: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default) over sorted values."""
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(slots=True)
class Buffering:
    """Whether something between server and client held tokens back, and the evidence."""

    stamps: bool
    detected: bool | None  # None: no stamps, so arrival times alone cannot tell
    findings: list[str] = field(default_factory=list)
    sub_ms_gap_share: float = 0.0
    max_gap_s: float | None = None
    gap_cv: float | None = None
    collapsed_bursts: int = 0
    collapsed_tokens: int = 0
    send_span_s: float | None = None
    receive_span_s: float | None = None


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def clock_offset(received: list[float], sent: list[float]) -> float | None:
    """min(receive - send) over stamped events: clock offset plus the least network delay."""
    return min((r - s for r, s in zip(received, sent, strict=True)), default=None)


def assess(headers_at: float | None, received: list[float], sent: list[float] | None) -> Buffering:
    """Buffering verdict for token arrival times and, with stamps, their aligned send times
    (both on the client's axis: send times shifted by `clock_offset`)."""
    between = gaps(received)
    verdict = Buffering(stamps=sent is not None, detected=None)
    if between:
        verdict.sub_ms_gap_share = sum(g < BURST_GAP_S for g in between) / len(between)
        verdict.max_gap_s = max(between)
        mean = statistics.fmean(between)
        verdict.gap_cv = statistics.pstdev(between) / mean if mean > 0 else None
    if received:
        verdict.receive_span_s = received[-1] - received[0]
    if sent is None:
        verdict.findings.append(NO_STAMPS)
        if _headers_with_last_token(headers_at, received):
            verdict.findings.append(
                "the response headers arrived with the last token: the whole response came at"
                " once (a buffer, or a server that writes everything at the end)"
            )
        return verdict
    verdict.send_span_s = sent[-1] - sent[0] if sent else None
    _collapsed_bursts(received, sent, verdict)
    _headers_waited(headers_at, received, verdict)
    verdict.detected = bool(verdict.findings)
    return verdict


def _headers_with_last_token(headers_at: float | None, received: list[float]) -> bool:
    return (
        headers_at is not None
        and len(received) >= MIN_BURST
        and (received[-1] - headers_at < BURST_GAP_S)
    )


def bursts(received: list[float]) -> list[range]:
    """Index ranges of consecutive tokens that arrived less than BURST_GAP_S apart."""
    found, start = [], 0
    for i in range(1, len(received) + 1):
        if i == len(received) or received[i] - received[i - 1] >= BURST_GAP_S:
            found.append(range(start, i))
            start = i
    return found


def _collapsed_bursts(received: list[float], sent: list[float], verdict: Buffering) -> None:
    collapsed = [burst for burst in bursts(received) if _collapsed(burst, received, sent)]
    verdict.collapsed_bursts = len(collapsed)
    verdict.collapsed_tokens = sum(len(burst) for burst in collapsed)
    if received and verdict.collapsed_tokens >= COLLAPSED_SHARE * len(received):
        widest = max(sent[b[-1]] - sent[b[0]] for b in collapsed)
        verdict.findings.append(
            f"{verdict.collapsed_tokens} of {len(received)} tokens arrived in"
            f" {len(collapsed)} burst(s) (gaps < 1 ms) though sent up to {widest * 1e3:.0f} ms"
            " apart: something between server and client holds tokens back"
        )


def _collapsed(burst: range, received: list[float], sent: list[float]) -> bool:
    """Sent over COLLAPSED_SEND_SPAN_S or more, received in a tenth of that time or less
    (a fast server's tokens also chain into sub-ms gaps, but keep their pace)."""
    send_span = sent[burst[-1]] - sent[burst[0]]
    receive_span = received[burst[-1]] - received[burst[0]]
    return (
        len(burst) >= MIN_BURST
        and send_span >= COLLAPSED_SEND_SPAN_S
        and receive_span <= COLLAPSE_RATIO * send_span
    )


def _headers_waited(headers_at: float | None, received: list[float], verdict: Buffering) -> None:
    span = verdict.send_span_s
    if headers_at is None or span is None or span < COLLAPSED_SEND_SPAN_S:
        return
    if received[-1] - headers_at <= COLLAPSE_RATIO * span:
        verdict.findings.append(
            f"the response headers came with the tokens (all within"
            f" {(received[-1] - headers_at) * 1e3:.1f} ms) though the server took"
            f" {span * 1e3:.0f} ms to send them: the first byte waited for the last token"
        )
