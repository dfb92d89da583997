"""zerohop.api.load.live_load: the per-second live load behind GET /v1/admin/live."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from zerohop.api.load import latency_histogram as hist
from zerohop.api.load import live_load
from zerohop.api.load.live_load import LiveLoad


def stats(
    running: int = 0,
    waiting: int = 0,
    blocks: int = 100,
    used: int = 0,
    query: int = 0,
    hit: int = 0,
) -> dict[str, int]:
    return {
        "num_blocks": blocks,
        "blocks_in_use": used,
        "blocks_cached": 0,
        "num_running": running,
        "num_waiting": waiting,
        "prefix_query_tokens": query,
        "prefix_hit_tokens": hit,
    }


def nearest_rank(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q, method="inverted_cdf"))


def test_rates_refusals_and_input_tokens() -> None:
    ll = LiveLoad()
    ll.sample(stats(), now=100.0)
    ll.on_tokens("a", 5)
    ll.on_tokens("b", 3)
    ll.on_tokens("a", 2)
    ll.on_finished("a", 200, 100, 40, 0.5, [1.0, 1.1])
    ll.on_finished("a", 429, 0, 0, None, [])  # refused
    ll.on_finished("b", 503, 0, 0, None, [])  # refused
    ll.on_finished("b", 529, 0, 0, None, [])  # refused
    ll.on_finished("b", 500, 0, 0, None, [])  # failed, not refused
    ll.on_finished("b", 429, 7, 0, None, [])  # read the prompt first: not a refusal
    ll.sample(stats(), now=101.0)
    ll.on_tokens("a", 8)
    ll.on_finished("a", 200, 30, 0, 0.2, [])
    ll.on_finished("a", 200, 10, 20, 0.2, [])  # cached > prompt: no negative input
    ll.sample(stats(), now=103.0)  # a late sample: the point covers 2 s
    w = ll.window()
    assert w["t"] == [100.0, 101.0, 103.0]
    assert w["interval"] == 1.0
    assert w["requests_per_s"] == [0.0, 6.0, 1.0]
    assert w["refusals_per_s"] == [0.0, 3.0, 0.0]
    assert w["output_tokens_per_s"] == [0.0, 10.0, 4.0]
    assert w["input_tokens_per_s"] == [0.0, 67.0, 15.0]
    assert w["tenants"] == {"a": [0.0, 7.0, 4.0], "b": [0.0, 3.0, 0.0]}
    assert w["summary"]["requests"] == 8
    assert w["summary"]["output_tokens"] == 18
    assert ll.window(1)["summary"]["requests"] == 2
    assert ll.window(1)["t"] == [103.0]
    json.dumps(w, allow_nan=False)  # JSON-ready


def test_gauges_and_kv_fraction() -> None:
    ll = LiveLoad()
    ll.sample(stats(running=4, waiting=2, blocks=200, used=50), now=1.0)
    ll.sample(None, now=2.0)  # the engine restarting
    ll.sample(stats(running=1, waiting=0, blocks=0, used=0), now=3.0)
    ll.sample({"num_running": 1}, now=4.0)  # incomplete: treated as no stats
    ll.sample(stats(blocks=8, used=8), now=5.0)
    w = ll.window()
    assert w["running"] == [4, None, 1, None, 0]
    assert w["waiting"] == [2, None, 0, None, 0]
    assert w["kv_cache_use"] == [0.25, None, None, None, 1.0]


def test_prefix_hit_rate_and_restart() -> None:
    ll = LiveLoad()
    ll.sample(stats(query=1000, hit=500), now=1.0)  # a baseline: no rate yet
    ll.sample(stats(query=1400, hit=800), now=2.0)  # 300 of 400
    ll.sample(stats(query=1400, hit=800), now=3.0)  # nothing queried
    ll.sample(None, now=4.0)  # restarting
    ll.sample(stats(query=200, hit=50), now=5.0)  # restarted: counts from zero
    ll.sample(stats(query=300, hit=150), now=6.0)  # 100 of 100
    w = ll.window()
    assert w["prefix_hit_rate"] == [None, 0.75, None, None, 0.25, 1.0]
    assert all(r is None or 0.0 <= r <= 1.0 for r in w["prefix_hit_rate"])


def test_percentiles_are_numpy_nearest_rank_to_a_bucket() -> None:
    rng = np.random.default_rng(7)
    ll = LiveLoad(window=100.0)
    ttfts: list[float] = []
    gaps: list[float] = []
    for second in range(4):
        for _ in range(9):
            ttft = float(rng.uniform(0.05, 2.0))
            times = np.cumsum(rng.uniform(0.001, 0.2, size=int(rng.integers(1, 30))))
            ll.on_finished("t", 200, 10, 0, ttft, times.tolist())
            ttfts.append(ttft)
            gaps.extend(np.diff(times).tolist())
        ll.sample(stats(), now=10.0 + second)
    w = ll.window()
    expected = {
        "ttft_p50": nearest_rank(ttfts, 50),
        "ttft_p95": nearest_rank(ttfts, 95),
        "itl_p50": nearest_rank(gaps, 50),
        "itl_p95": nearest_rank(gaps, 95),
    }
    for key, value in expected.items():  # a bucket's middle: within half its 9% width
        assert w["summary"][key] == pytest.approx(value, rel=0.045)
        assert w[key][-1] == w["summary"][key]  # the trailing window covers all 4
    assert w["ttft_p50"][0] == pytest.approx(nearest_rank(ttfts[:9], 50), rel=0.045)


def near(values: list[float | None]) -> list:
    """Within a latency bucket's half width of each value (None: none)."""
    return [None if v is None else pytest.approx(v, rel=0.045) for v in values]


def test_trailing_window() -> None:
    ll = LiveLoad(window=3.0)
    for i in range(6):
        ll.on_finished("t", 200, 10, 0, float(i + 1), [0.0, 0.01 * (i + 1)])
        ll.sample(stats(), now=float(i))
    ll.sample(stats(), now=6.0)  # nothing finished in this second
    ll.sample(stats(), now=9.0)  # nothing in the last 3 s
    w = ll.window()
    # point i covers the ttfts of points i-2..i: [1], [1,2], [1,2,3], [2,3,4], ...
    assert w["ttft_p50"] == near([1.0, 1.0, 2.0, 3.0, 4.0, 5.0, 5.0, None])
    assert w["ttft_p95"] == near([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 6.0, None])
    assert w["itl_p95"][:3] == near([0.01, 0.02, 0.03])
    assert w["itl_p50"][-1] is None
    assert w["summary"]["ttft_p50"] == pytest.approx(3.0, rel=0.045)
    assert w["summary"]["ttft_p95"] == pytest.approx(6.0, rel=0.045)
    assert ll.window(2)["summary"]["ttft_p50"] is None


def test_ring_drops_oldest() -> None:
    ll = LiveLoad(seconds=5)
    for i in range(12):
        ll.on_tokens("t", i)
        ll.sample(stats(), now=float(i))
    w = ll.window(5)
    assert w["t"] == [7.0, 8.0, 9.0, 10.0, 11.0]
    assert w["output_tokens_per_s"] == [7.0, 8.0, 9.0, 10.0, 11.0]
    assert w["summary"]["output_tokens"] == 45
    assert len(ll._points) == 5


def test_a_point_holds_histograms_not_samples() -> None:
    ll = LiveLoad()
    times = [0.001 * i * (i + 1) / 2 for i in range(10_001)]  # gaps 0.001, 0.002, ... 10.0
    ll.on_finished("t", 200, 10, 0, 0.1, times)
    for i in range(1000):
        ll.on_finished("t", 200, 10, 0, float(i), [])
    ll.sample(stats(), now=1.0)
    counts = ll._points[-1].c
    assert counts.gaps == [] and counts.ttfts == []  # counted, not kept
    assert counts.gap_hist.sum() == 10_000 and counts.ttft_hist.sum() == 1001
    assert counts.gap_hist.shape == (hist.BUCKETS,)
    assert ll.window()["itl_p50"][-1] == pytest.approx(5.0, rel=0.05)
    assert ll.window()["ttft_p50"][-1] == pytest.approx(499.0, rel=0.05)


def test_the_ring_totals_follow_points_in_and_out_and_since_sends_only_new_points() -> None:
    ll = LiveLoad(seconds=3, window=1.0)
    for second in range(5):  # TTFTs of 0.01, 0.1, 1, 10, 100 s: the ring keeps the last 3
        ll.on_finished("t", 200, 10, 0, 10.0 ** (second - 2), [])
        ll.sample(stats(), now=100.0 + second)
    summary = ll.window(3)["summary"]
    assert summary["requests"] == 3
    assert summary["ttft_p50"] == pytest.approx(10.0, rel=0.045)
    assert summary["ttft_p95"] == pytest.approx(100.0, rel=0.045)
    assert ll.window(2)["summary"]["ttft_p50"] == pytest.approx(10.0, rel=0.045)
    newer = ll.window(3, since=103.0)
    assert newer["t"] == [104.0] and newer["requests_per_s"] == [1.0]
    assert newer["summary"] == summary  # the summary still covers the 3 seconds
    assert ll.window(3, since=104.0)["t"] == []


def test_tenants_capped() -> None:
    ll = LiveLoad()
    for i in range(25):
        ll.on_tokens(f"t{i:02d}", i + 1)  # t24 busiest, t00 least
    ll.sample(stats(), now=1.0)
    ll.on_tokens("t00", 1)
    ll.sample(stats(), now=2.0)
    tenants = ll.window()["tenants"]
    assert list(tenants) == [f"t{i:02d}" for i in range(24, 4, -1)] + ["other"]
    assert tenants["t24"] == [25.0, 0.0]
    assert tenants["other"] == [1.0 + 2 + 3 + 4 + 5, 1.0]  # t00..t04


def test_point_tenants_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(live_load, "MAX_POINT_TENANTS", 3)
    ll = LiveLoad()
    for i in range(6):
        ll.on_tokens(f"t{i}", 10 * (i + 1))
    ll.sample(stats(), now=1.0)
    assert ll._points[-1].c.tenants == {"t5": 60, "t4": 50, "t3": 40, "other": 60}


def test_validation() -> None:
    with pytest.raises(ValueError):
        LiveLoad(seconds=0)
    with pytest.raises(ValueError):
        LiveLoad(window=0)
    ll = LiveLoad(seconds=10)
    for bad in (0, 11, -1, 1.5, True, "5"):
        with pytest.raises(ValueError):
            ll.window(bad)  # type: ignore[arg-type]
    assert ll.window(10)["t"] == []
    assert ll.window(1)["summary"] == {
        "requests": 0,
        "output_tokens": 0,
        "ttft_p50": None,
        "ttft_p95": None,
        "itl_p50": None,
        "itl_p95": None,
    }
    assert LiveLoad().window()["t"] == []  # the default is the default capacity


def test_window_keys() -> None:
    ll = LiveLoad()
    ll.sample(stats(), now=1.0)
    assert list(ll.window()) == [
        "interval",
        "t",
        "requests_per_s",
        "refusals_per_s",
        "output_tokens_per_s",
        "input_tokens_per_s",
        "running",
        "waiting",
        "kv_cache_use",
        "prefix_hit_rate",
        "ttft_p50",
        "ttft_p95",
        "itl_p50",
        "itl_p95",
        "tenants",
        "summary",
    ]


def test_run_samples_and_survives_a_failing_stats() -> None:
    calls = 0

    def engine_stats() -> dict[str, int]:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("engine restarting")
        return stats(running=calls)

    async def main() -> dict:
        ll = LiveLoad()
        task = asyncio.create_task(ll.run(engine_stats, interval=0.02))
        ll.on_tokens("t", 3)
        for _ in range(500):
            await asyncio.sleep(0.01)
            if len(ll._points) >= 5:
                break
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return ll.window()

    w = asyncio.run(main())
    assert len(w["t"]) >= 5
    assert w["interval"] == 0.02
    assert w["running"][:3] == [1, None, 3]
    assert w["summary"]["output_tokens"] == 3
    assert w["t"] == sorted(w["t"])


def test_latency_histogram_buckets_and_percentiles() -> None:
    h = hist.empty()
    hist.add(h, [0.002, 0.002, 0.003, float("nan"), float("inf"), -1.0, 1e-9, 5e4])
    assert h.sum() == 5  # NaN, infinity and negatives dropped; the tiny and huge clipped
    assert h[0] == 1 and h[-1] == 1
    assert hist.percentile(h, 50) == pytest.approx(0.002, rel=0.045)
    assert hist.percentile(h, 70) == pytest.approx(0.003, rel=0.045)
    assert hist.percentile(hist.empty(), 50) is None
    assert hist.percentile(hist.total([h, h]), 50) == hist.percentile(h, 50)
