"""GatewayMetrics: what the request path records and `/metrics` exposes (no server here)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from zerohop.engine.base.outputs import EngineStats
from zerohop.gateway.metrics import ITL_BUCKETS, GatewayMetrics

MODEL = "SmolLM2-135M-Instruct"


def engine_stats(**changes: int) -> dict:
    stats = EngineStats(
        num_blocks=200,
        blocks_in_use=50,
        blocks_cached=120,  # includes free blocks that still hold a prefix
        blocks_free=150,
        prefix_query_tokens=4096,
        prefix_hit_tokens=1024,
        num_running=3,
        num_waiting=7,
    )
    return dataclasses.asdict(dataclasses.replace(stats, **changes))


def parse(body: bytes) -> dict[tuple[str, frozenset], float]:
    """(sample name, labels) -> value, for every sample in the exposition."""
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            key = (sample.name, frozenset(sample.labels.items()))
            assert key not in out, key
            out[key] = sample.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def acme_ok(samples: dict) -> float:
    return value(
        samples, "zerohop_requests_total", surface="anthropic", status="200", tenant="acme"
    )


def finish(metrics: GatewayMetrics, **overrides) -> None:
    args = dict(
        surface="anthropic",
        status=200,
        tenant="acme",
        model=MODEL,
        prompt_tokens=100,
        cached_tokens=64,
        output_tokens=5,
        ttft_s=0.03,
        e2e_s=0.4,
        queue_s=0.002,
        token_times=[10.0, 10.004, 10.012, 10.05, 10.3],
    )
    args.update(overrides)
    metrics.request_finished(**args)


def test_request_counters_by_surface_status_and_tenant():
    m = GatewayMetrics(MODEL, request_metrics_max_age_s=0)
    finish(m)
    finish(m)
    finish(m, surface="openai_chat", tenant="globex", prompt_tokens=10, cached_tokens=0)
    finish(m, status=429, output_tokens=0, ttft_s=None, queue_s=None, token_times=None)
    s = parse(m.render(None)[0])
    assert acme_ok(s) == 2
    assert value(s, "zerohop_requests_total", surface="anthropic", status="429", tenant="acme") == 1
    assert (
        value(s, "zerohop_requests_total", surface="openai_chat", status="200", tenant="globex")
        == 1
    )
    # prompt tokens counted are the uncached ones; the cached ones have their own counter
    assert value(s, "zerohop_prompt_tokens_total", tenant="acme") == 3 * 36
    assert value(s, "zerohop_cached_prompt_tokens_total", tenant="acme") == 3 * 64
    assert value(s, "zerohop_prompt_tokens_total", tenant="globex") == 10
    assert value(s, "zerohop_cached_prompt_tokens_total", tenant="globex") == 0
    assert value(s, "zerohop_output_tokens_total", tenant="acme") == 10
    assert value(s, "zerohop_output_tokens_total", tenant="globex") == 5
    # no label by model (client-controlled); nothing from the engine without its stats
    assert not any("model" in dict(labels) for _, labels in s)
    assert not any(name.startswith(("vllm:", "zerohop_kv_", "zerohop_prefix")) for name, _ in s)


def test_histograms():
    m = GatewayMetrics(MODEL, request_metrics_max_age_s=0)
    finish(m)  # 5 token times: 4 gaps of 4 ms, 8 ms, 38 ms, 250 ms
    finish(m, token_times=[5.0] + [5.0 + 0.02 * i for i in range(1, 64)])  # 64 tokens
    finish(m, token_times=[7.0])  # one token: no gap
    finish(m, status=500, ttft_s=None, queue_s=None, token_times=None)
    s = parse(m.render(None)[0])

    itl = "zerohop_inter_token_latency_seconds"
    assert value(s, itl + "_count") == 4 + 63
    assert value(s, itl + "_sum") == pytest.approx(0.3 + 63 * 0.02)
    assert value(s, itl + "_bucket", le="0.005") == 1
    assert value(s, itl + "_bucket", le="0.01") == 2
    assert value(s, itl + "_bucket", le="0.025") == 2 + 63
    assert value(s, itl + "_bucket", le="0.05") == 3 + 63
    assert value(s, itl + "_bucket", le="0.3") == 4 + 63
    assert value(s, itl + "_bucket", le="+Inf") == 4 + 63
    les = sorted(float(dict(lb)["le"]) for n, lb in s if n == itl + "_bucket")
    assert les[:-1] == list(ITL_BUCKETS) and math.isinf(les[-1])
    # vLLM's bounds are all there, so dashboards written for vLLM read these the same way
    assert {0.01, 0.025, 0.05, 0.075, 0.1, 80.0} <= set(les)

    ttft = "zerohop_time_to_first_token_seconds"
    assert value(s, ttft + "_count") == 3  # the request with no token is not observed
    assert value(s, ttft + "_sum") == pytest.approx(0.09)
    assert value(s, ttft + "_bucket", le="0.02") == 0
    assert value(s, ttft + "_bucket", le="0.04") == 3
    assert value(s, "zerohop_e2e_request_latency_seconds_count") == 4
    assert value(s, "zerohop_e2e_request_latency_seconds_sum") == pytest.approx(1.6)
    assert value(s, "zerohop_e2e_request_latency_seconds_bucket", le="0.3") == 0
    assert value(s, "zerohop_e2e_request_latency_seconds_bucket", le="0.5") == 4
    assert value(s, "zerohop_request_queue_time_seconds_count") == 3
    assert value(s, "zerohop_request_queue_time_seconds_bucket", le="0.0025") == 3
    assert value(s, "zerohop_request_queue_time_seconds_bucket", le="0.001") == 0


def test_refusals_by_reason_and_tenant():
    m = GatewayMetrics(MODEL, request_metrics_max_age_s=0)
    m.refused("rate_limit_requests", "acme")
    m.refused("rate_limit_requests", "acme")
    m.refused("budget", "acme")
    m.refused("authentication", "")
    s = parse(m.render(None)[0])
    assert value(s, "zerohop_refusals_total", reason="rate_limit_requests", tenant="acme") == 2
    assert value(s, "zerohop_refusals_total", reason="budget", tenant="acme") == 1
    assert value(s, "zerohop_refusals_total", reason="authentication", tenant="") == 1


def test_engine_gauges_and_vllm_names():
    m = GatewayMetrics(MODEL, block_size=16)
    body, content_type = m.render(engine_stats())
    assert content_type.startswith("text/plain; version=0.0.4")
    text = body.decode()
    # colons survive as they are (legal in Prometheus metric names), not escaped to "_"
    assert '\nvllm:num_requests_waiting{engine="0",model_name="SmolLM2-135M-Instruct"} 7.0\n' in (
        text
    )
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert types["vllm:num_requests_running"] == types["vllm:kv_cache_usage_perc"] == "gauge"
    assert types["zerohop_prefix_cache_queries"] == types["zerohop_prefix_cache_hits"] == "counter"

    s = parse(body)
    vllm = {"model_name": MODEL, "engine": "0"}
    assert value(s, "vllm:num_requests_running", **vllm) == 3
    assert value(s, "vllm:num_requests_waiting", **vllm) == 7
    # a 0-1 fraction, as vLLM reports it; blocks held by requests only (50 of 200), not the
    # free blocks that still hold a cached prefix
    assert value(s, "vllm:kv_cache_usage_perc", **vllm) == 0.25
    assert value(s, "zerohop_kv_cache_usage_ratio") == 0.25
    assert value(s, "zerohop_kv_cache_blocks") == 200
    assert value(s, "zerohop_requests_running") == 3
    assert value(s, "zerohop_requests_waiting") == 7
    assert (
        value(s, "vllm:cache_config_info", block_size="16", num_gpu_blocks="200", engine="0") == 1
    )


def test_prefix_counters_follow_the_engine_totals_without_double_counting():
    m = GatewayMetrics(MODEL)
    s = parse(m.render(engine_stats())[0])
    assert value(s, "zerohop_prefix_cache_queries_total") == 4096
    assert value(s, "zerohop_prefix_cache_hits_total") == 1024
    s = parse(m.render(engine_stats())[0])  # the same totals again: unchanged
    assert value(s, "zerohop_prefix_cache_queries_total") == 4096
    assert value(s, "zerohop_prefix_cache_hits_total") == 1024
    s = parse(m.render(engine_stats(prefix_query_tokens=5000, prefix_hit_tokens=2048))[0])
    assert value(s, "zerohop_prefix_cache_queries_total") == 5000
    assert value(s, "zerohop_prefix_cache_hits_total") == 2048
    # the engine not answering: its metrics are left out rather than reported stale
    s = parse(m.render(None)[0])
    assert not any(name.startswith(("vllm:", "zerohop_prefix", "zerohop_kv")) for name, _ in s)


def test_request_section_is_cached_for_max_age_but_engine_section_is_fresh(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("zerohop.gateway.metrics.time.monotonic", lambda: clock[0])
    m = GatewayMetrics(MODEL, request_metrics_max_age_s=1.0)
    finish(m)
    s = parse(m.render(engine_stats())[0])
    assert acme_ok(s) == 1
    finish(m)
    clock[0] += 0.5
    s = parse(m.render(engine_stats(num_waiting=9))[0])
    assert acme_ok(s) == 1
    assert value(s, "vllm:num_requests_waiting", model_name=MODEL, engine="0") == 9
    clock[0] += 0.5
    s = parse(m.render(engine_stats())[0])
    assert acme_ok(s) == 2


def test_servers_in_one_process_do_not_share_metrics():
    a, b = GatewayMetrics("a", request_metrics_max_age_s=0), GatewayMetrics("b")
    finish(a)
    sb = parse(b.render(engine_stats())[0])
    assert not any(name == "zerohop_requests_total" for name, _ in sb)
    assert value(sb, "vllm:num_requests_running", model_name="b", engine="0") == 3
    sa = parse(a.render(None)[0])
    assert acme_ok(sa) == 1
