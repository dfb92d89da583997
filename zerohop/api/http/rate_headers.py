"""Rate-limit response headers, in each API's own names, from the gateway's buckets.

Anthropic: `anthropic-ratelimit-{requests,input-tokens,output-tokens,tokens}-{limit,
remaining,reset}`, reset as an RFC 3339 time (when the bucket is full again). OpenAI:
`x-ratelimit-{limit,remaining,reset}-{requests,tokens}`, reset as a duration ("1.5s",
"6m0s"). `tokens` is the more restrictive of the input and output buckets.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

from zerohop.gateway.gateway import Call, Gateway
from zerohop.gateway.limits.buckets import RateState

Headers = list[tuple[bytes, bytes]]
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
    return headers


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
