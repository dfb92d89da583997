"""Rate-limit response headers, in each API's own names, from the gateway's buckets.

Anthropic: `anthropic-ratelimit-{requests,input-tokens,output-tokens,tokens}-{limit,
remaining,reset}`, reset as an RFC 3339 time (when the bucket is full again). OpenAI:
`x-ratelimit-{limit,remaining,reset}-{requests,tokens}`, reset as a duration ("1.5s",
"6m0s"). `tokens` is the more restrictive of the input and output buckets.

Anthropic's unified headers too, as Claude Code reads them (its usage warnings, and the
limit and reset it names on a refusal): per window `anthropic-ratelimit-unified-{5h,7d}-
{utilization,reset,status,surpassed-threshold}` (utilization a fraction of 1, reset unix
seconds, status allowed | allowed_warning | rejected, the highest of 0.75, 0.95 and 1 passed),
and for the most used window `anthropic-ratelimit-unified-{status,reset,representative-
claim}`. Claude Code knows only its own windows' names: zerohop's per-minute rate limits are
the short window (5h, "five_hour"), the key's and tenant's token budgets (per day, month or
in total) the long one (7d, "seven_day"); the values are zerohop's own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime

from zerohop.gateway.budget_view import readings
from zerohop.gateway.gateway import Call, Gateway
from zerohop.gateway.limits.buckets import RateState

Headers = list[tuple[bytes, bytes]]
THRESHOLDS = (0.75, 0.95, 1.0)  # warnings from 75% and 95%; 1: rejected
UNIFIED = "anthropic-ratelimit-unified-"
_ANTHROPIC_NAMES = {
    "requests": "requests",
    "input_tokens": "input-tokens",
    "output_tokens": "output-tokens",
}


def _with_tokens(states: dict[str, RateState]) -> dict[str, RateState]:
    token_states = [states[k] for k in ("input_tokens", "output_tokens") if k in states]
    if token_states:
        states = {**states, "tokens": min(token_states, key=lambda s: s.remaining)}
    return states


def anthropic_rate_headers(gateway: Gateway, call: Call) -> Headers:
    states = _with_tokens(gateway.rate_state(call))
    now = time.time()
    headers: Headers = []
    for kind, state in states.items():
        name = _ANTHROPIC_NAMES.get(kind, kind)
        reset = datetime.fromtimestamp(now + state.reset_after, UTC)
        prefix = f"anthropic-ratelimit-{name}-".encode()
        headers += [
            (prefix + b"limit", str(state.limit).encode()),
            (prefix + b"remaining", str(state.remaining).encode()),
            (
                prefix + b"reset",
                reset.isoformat(timespec="seconds").replace("+00:00", "Z").encode(),
            ),
        ]
    return headers + unified_headers(gateway, call, states, now)


@dataclass(slots=True, frozen=True)
class Window:
    claim: str  # Claude Code's rateLimitType
    abbrev: str  # its header infix
    utilization: float
    resets_at: float | None

    @property
    def status(self) -> str:
        if self.utilization >= 1.0:
            return "rejected"
        return "allowed_warning" if self.utilization >= THRESHOLDS[0] else "allowed"

    def headers(self) -> Headers:
        prefix = f"{UNIFIED}{self.abbrev}-"
        out = [(f"{prefix}utilization", f"{round(self.utilization, 4)}")]
        if self.resets_at is not None:
            out.append((f"{prefix}reset", str(int(self.resets_at))))
        out.append((f"{prefix}status", self.status))
        passed = [t for t in THRESHOLDS if self.utilization >= t]
        if passed:
            out.append((f"{prefix}surpassed-threshold", str(passed[-1])))
        return [(k.encode(), v.encode()) for k, v in out]


def unified_headers(
    gateway: Gateway, call: Call, states: dict[str, RateState], now: float
) -> Headers:
    """The unified headers of the key's rate limits and budgets; none where it has neither."""
    windows = [w for w in (_rate_window(states, now), _budget_window(gateway, call, now)) if w]
    if not windows:
        return []
    top = max(windows, key=lambda w: w.utilization)
    headers = [h for w in windows for h in w.headers()]
    headers += [
        (f"{UNIFIED}status".encode(), top.status.encode()),
        (f"{UNIFIED}representative-claim".encode(), top.claim.encode()),
    ]
    if top.resets_at is not None:
        headers.append((f"{UNIFIED}reset".encode(), str(int(top.resets_at)).encode()))
    return headers


def _rate_window(states: dict[str, RateState], now: float) -> Window | None:
    used = [(1 - s.remaining / s.limit, s) for s in states.values() if s.limit > 0]
    if not used:
        return None
    fraction, state = max(used, key=lambda pair: pair[0])
    return Window("five_hour", "5h", max(0.0, fraction), now + state.reset_after)


def _budget_window(gateway: Gateway, call: Call, now: float) -> Window | None:
    known = [r for r in readings(call.identity, gateway.ledger, now) if r.utilization is not None]
    if not known:
        return None
    top = max(known, key=lambda r: r.utilization or 0.0)
    return Window("seven_day", "7d", top.utilization or 0.0, top.resets_at)


def openai_rate_headers(gateway: Gateway, call: Call) -> Headers:
    states = _with_tokens(gateway.rate_state(call))
    headers: Headers = []
    for kind in ("requests", "tokens"):
        if (state := states.get(kind)) is None:
            continue
        headers += [
            (f"x-ratelimit-limit-{kind}".encode(), str(state.limit).encode()),
            (f"x-ratelimit-remaining-{kind}".encode(), str(state.remaining).encode()),
            (f"x-ratelimit-reset-{kind}".encode(), _duration(state.reset_after).encode()),
        ]
    return headers


def _duration(seconds: float) -> str:
    """OpenAI's style: "17ms", "1.5s", "6m0s"."""
    if seconds < 1:
        return f"{int(seconds * 1000)}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes}m{rest}s"
