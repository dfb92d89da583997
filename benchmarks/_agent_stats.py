"""The agent session's summary over its warm turns: least-squares fits of TTFT and of the time
to message_start against new tokens, their correlations with new tokens and with the prompt's
length, recomputed over new tokens, the cached share, and the forced calls' validity."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def summary(turns: Sequence[Any]) -> dict[str, Any]:
    warm = turns[1:]
    text = [t for t in warm if not t.forced and t.ttft_s is not None]
    forced = [t for t in turns if t.forced]
    return {
        "turns": len(turns),
        "turn1_prompt_tokens": turns[0].prompt if turns else None,
        "turn1_ttft_ms": _ms_or_none(turns[0].ttft_s) if turns else None,
        # TTFT (first content_block_delta) on warm turns that answer in text: a forced call's
        # first delta comes after the call's opening tokens are decoded (see below).
        "ttft_fit": fit([t for t in text], "ttft_s"),
        # Time to message_start on every warm turn, forced or not (the server sends it with
        # the engine's first delta: a warm turn's prefill is one chunk, so its first token).
        "message_start_fit": fit(
            [t for t in warm if t.message_start_s is not None], "message_start_s"
        ),
        "forced_ttft_ms_median": _median([t.ttft_s * 1000 for t in forced if t.ttft_s]),
        "forced_message_start_ms_median": _median(
            [t.message_start_s * 1000 for t in forced if t.message_start_s]
        ),
        **token_ratios(warm),
        **forced_calls(forced, [t.stop_reason == "max_tokens" for t in forced]),
        "client_minus_server_ttft_ms_median": client_minus_server(turns),
    }


def token_ratios(warm: Sequence[Any]) -> dict[str, float | None]:
    """Recomputed over new and over unseen tokens, and the share read from the cache."""
    sum_new = sum(t.new for t in warm)
    sum_unseen = sum(t.unseen or 0 for t in warm)
    sum_recomputed = sum(t.recomputed for t in warm)
    return {
        "recomputed_over_new": sum_recomputed / sum_new if sum_new else None,
        "recomputed_over_unseen": sum_recomputed / sum_unseen if sum_unseen > 0 else None,
        "warm_cached_share": (
            sum(t.cached for t in warm) / sum(t.prompt for t in warm) if warm else None
        ),
    }


def forced_calls(forced: Sequence[Any], cut: list[bool]) -> dict[str, int]:
    """The forced calls, the valid ones, those cut (by the output limit) and the valid ones
    of those that ended."""
    return {
        "forced_calls": len(forced),
        "forced_calls_valid": sum(bool(t.valid) for t in forced),
        # A call cut by max_tokens streamed only part of its input (as the API does): the
        # grammar's promise is for a call that ends, so those are counted apart.
        "forced_calls_cut": sum(cut),
        "forced_calls_ended_valid": sum(
            bool(t.valid) for t, c in zip(forced, cut, strict=True) if not c
        ),
    }


def client_minus_server(turns: Sequence[Any]) -> float | None:
    return _median(
        [(t.ttft_s - t.server_ttft_s) * 1000 for t in turns if t.ttft_s and t.server_ttft_s]
    )


def fit(turns: Sequence[Any], key: str) -> dict[str, Any]:
    """Least squares of `key` (ms) against new tokens, and its correlation with new tokens
    and with the prompt's length."""
    ms = [getattr(t, key) * 1000 for t in turns]
    new = [float(t.new) for t in turns]
    prompt = [float(t.prompt) for t in turns]
    slope = intercept = None
    if len(turns) >= 2 and len(set(new)) > 1:
        slope, intercept = statistics.linear_regression(new, ms)
    return {
        "n": len(turns),
        "median_ms": _median(ms),
        "ms_per_new_token": slope,
        "intercept_ms": intercept,
        "corr_new_tokens": _corr(new, ms),
        "corr_prompt_tokens": _corr(prompt, ms),
    }


def _ms_or_none(v: float | None) -> float | None:
    return None if v is None else v * 1000


def _corr(x: list[float], y: list[float]) -> float | None:
    if len(x) < 3 or len(set(x)) < 2 or len(set(y)) < 2:
        return None  # two points always lie on a line
    return statistics.correlation(x, y)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None
