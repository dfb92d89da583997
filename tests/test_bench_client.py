"""The `zerohop bench` load client against the live server: counts and metrics consistent."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.live_server import MODEL_NAME
from zerohop.bench.load import BenchConfig, RequestResult, run_benchmark, summarize
from zerohop.cli import main

INPUT_TOKENS = 12
OUTPUT_TOKENS = 8


def small_config(url: str, **overrides: object) -> BenchConfig:
    options = {
        "url": url,
        "concurrency": 2,
        "num_requests": 4,
        "input_tokens": INPUT_TOKENS,
        "output_tokens": OUTPUT_TOKENS,
        "warmup_requests": 0,
    }
    return BenchConfig(**(options | overrides))


def check_ordered(dist: dict) -> None:
    assert dist["min"] <= dist["p50"] <= dist["p90"] <= dist["p99"] <= dist["max"]
    assert dist["min"] <= dist["mean"] <= dist["max"]


def test_every_request_completes_with_consistent_metrics(live_server) -> None:
    report = run_benchmark(small_config(live_server.url))
    s, rows = report["summary"], report["requests"]
    assert s["completed"] == 4 and s["failed"] == 0 and s["errors"] == []
    assert len(rows) == 4
    for r in rows:
        assert r["ok"] and r["error"] is None
        assert r["output_tokens"] == OUTPUT_TOKENS  # ignore_eos: exactly max_tokens
        assert r["prompt_tokens"] == INPUT_TOKENS
        assert 1 <= r["events"] <= r["output_tokens"]
        assert 0 < r["ttft"] <= r["e2e"]
        assert len(r["itl"]) == r["events"] - 1
        assert all(gap >= 0 for gap in r["itl"])
        assert math.isclose(sum(r["itl"]), r["e2e"] - r["ttft"], abs_tol=1e-5)
    assert s["total_output_tokens"] == 4 * OUTPUT_TOKENS
    assert s["total_input_tokens"] == 4 * INPUT_TOKENS
    assert math.isclose(s["output_throughput"], 4 * OUTPUT_TOKENS / s["duration_s"])
    assert math.isclose(s["request_throughput"], 4 / s["duration_s"])
    assert s["checks"]["all_completed"]
    assert s["checks"]["output_tokens_as_requested"]
    assert s["checks"]["prompt_tokens_as_requested"]
    for key in ("ttft_ms", "tpot_ms", "e2el_ms"):
        assert s[key]["count"] == 4
        check_ordered(s[key])
    assert s["ttft_ms"]["max"] <= s["e2el_ms"]["max"]
    assert s["itl_ms"]["count"] == sum(r["events"] - 1 for r in rows)
    assert report["config"]["model"] is None  # resolved from GET /v1/models
    json.dumps(report)  # the report is plain JSON


def test_logprobs_give_every_token_its_event(live_server) -> None:
    report = run_benchmark(small_config(live_server.url, num_requests=2, logprobs=0))
    s = report["summary"]
    assert s["completed"] == 2 and s["checks"]["one_event_per_token"]
    for r in report["requests"]:
        assert r["events"] == r["output_tokens"] == OUTPUT_TOKENS
        assert len(r["itl"]) == OUTPUT_TOKENS - 1
    assert s["itl_ms"]["count"] == 2 * (OUTPUT_TOKENS - 1)


def test_cli_writes_the_report(live_server, tmp_path: Path, capsys) -> None:
    out = tmp_path / "bench.json"
    argv = [
        "bench", "--url", live_server.url + "/v1", "--model", MODEL_NAME,
        "--concurrency", "1", "--num-requests", "2", "--input-tokens", "5",
        "--output-tokens", "3", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["summary"]["completed"] == 2
    assert report["summary"]["total_output_tokens"] == 6
    assert "Time to First Token" in capsys.readouterr().out


def test_unknown_model_fails_every_request(live_server) -> None:
    report = run_benchmark(small_config(live_server.url, model="no-such-model", num_requests=2))
    s = report["summary"]
    assert s["completed"] == 0 and s["failed"] == 2
    assert s["errors"] and s["errors"][0].startswith("HTTP 404")


def test_tpot_follows_vllm_definition() -> None:
    def done(ttft: float, e2e: float, tokens: int) -> RequestResult:
        return RequestResult(ok=True, output_tokens=tokens, events=tokens, ttft=ttft, e2e=e2e)

    results = [done(0.1, 0.5, 5), done(0.2, 0.2, 1), RequestResult(error="x")]
    s = summarize(results, duration=2.0, cfg=BenchConfig(url="", output_tokens=5))
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["tpot_ms"]["count"] == 1  # one-token requests have no TPOT
    assert s["tpot_ms"]["mean"] == pytest.approx(100.0)  # (0.5 - 0.1) / (5 - 1)
    assert s["ttft_ms"]["p50"] == pytest.approx(150.0)
    assert s["output_throughput"] == pytest.approx(3.0)
    assert not s["checks"]["output_tokens_as_requested"]


def test_anthropic_messages_endpoint(live_server) -> None:
    cfg = small_config(live_server.url, endpoint="anthropic-messages", num_requests=2)
    report = run_benchmark(cfg)
    s = report["summary"]
    assert s["completed"] == 2 and s["failed"] == 0
    for r in report["requests"]:
        # No ignore_eos in the Messages API: at most max_tokens; the prompt is text sized
        # with count_tokens, so only approximately INPUT_TOKENS.
        assert 1 <= r["output_tokens"] <= OUTPUT_TOKENS
        assert r["prompt_tokens"] > 0
        assert 1 <= r["events"] <= r["output_tokens"]
        assert 0 < r["ttft"] <= r["e2e"]
