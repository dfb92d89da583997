"""The `zerohop bench` load client against the live server: counts and metrics consistent."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.live_server import MODEL_NAME
from zerohop.bench.arrivals import send_times
from zerohop.bench.load import run_benchmark
from zerohop.bench.load_types import BenchConfig, RequestResult
from zerohop.bench.metrics import parse_slo, summarize
from zerohop.bench.prompts import random_prompts
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


def test_open_loop_sends_at_the_rate_and_counts_goodput(live_server) -> None:
    cfg = small_config(
        live_server.url, request_rate=40.0, num_requests=12, concurrency=64,
        slo={"ttft": 60_000.0},
    )  # fmt: skip
    report = run_benchmark(cfg)
    s, rows = report["summary"], report["requests"]
    assert s["completed"] == 12 and s["request_rate"] == 40.0
    sent = sorted(r["sent_at"] for r in rows)
    assert sent[-1] > 0, "requests went out over time, not all at once"
    # The rate achieved: the requests after the first over the window they went out in. The
    # 12 gaps of seed 0's Poisson schedule average 47.8/s, well within the margin of 40/s.
    achieved = (len(sent) - 1) / (sent[-1] - sent[0])
    assert achieved == pytest.approx(40.0, rel=0.3), f"{achieved:.1f} requests/s sent"
    assert s["goodput"] == pytest.approx(s["request_throughput"])  # a lenient SLO: all met
    strict = summarize([RequestResult(**r) for r in rows], s["duration_s"],
                       BenchConfig(url="", slo={"ttft": 0.0001}))  # fmt: skip
    assert strict["goodput"] == 0.0


def test_a_timed_run_stops_sending_at_its_duration(live_server) -> None:
    cfg = small_config(live_server.url, duration_s=1.0, num_requests=100_000)
    report = run_benchmark(cfg)
    s = report["summary"]
    assert s["completed"] >= 2 and s["failed"] == 0
    assert max(r["sent_at"] for r in report["requests"]) < 1.0
    assert s["completed"] < 100_000


def test_send_times_follow_the_gamma_process() -> None:
    import itertools
    import statistics

    def gaps(burstiness: float) -> list[float]:
        times = list(itertools.islice(send_times(10.0, burstiness, seed=1), 20_001))
        return [b - a for a, b in itertools.pairwise(times)]

    poisson, bursty = gaps(1.0), gaps(0.25)
    assert statistics.mean(poisson) == pytest.approx(0.1, rel=0.05)
    assert statistics.mean(bursty) == pytest.approx(0.1, rel=0.1)
    cv = statistics.stdev(bursty) / statistics.mean(bursty)
    assert cv == pytest.approx(2.0, rel=0.15)  # a gamma's CV is 1 / sqrt(shape)
    with pytest.raises(ValueError):
        next(send_times(0.0))


def test_chat_endpoint_counts_one_event_per_token(live_server) -> None:
    report = run_benchmark(small_config(live_server.url, endpoint="openai-chat", num_requests=2))
    s = report["summary"]
    assert s["completed"] == 2 and s["checks"]["one_event_per_token"]
    assert s["checks"]["output_tokens_as_requested"]  # ignore_eos is sent


def test_errors_are_counted_by_type() -> None:
    results = [RequestResult(error="HTTP 529: overloaded"), RequestResult(error="HTTP 529: x"),
               RequestResult(error="ClientConnectorError: refused")]  # fmt: skip
    s = summarize(results, duration=1.0, cfg=BenchConfig(url=""))
    assert s["errors_by_type"] == {"HTTP 529": 2, "ClientConnectorError": 1}


def test_slo_parsing() -> None:
    assert parse_slo("ttft=500ms, tpot=0.05s") == {"ttft": 500.0, "tpot": 50.0}
    with pytest.raises(ValueError):
        parse_slo("latency=5ms")


def test_cli_sweeps_rates_then_compares_with_plots(live_server, tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    argv = [
        "bench", "--url", live_server.url, "--request-rate", "20,40", "--num-requests", "4",
        "--input-tokens", "5", "--output-tokens", "3", "--out", str(out),
        "--plot", str(tmp_path / "sweep"), "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["summary"]["request_rate"] for r in runs] == [20.0, 40.0]
    for name in ("sweep-latency-cdf.png", "sweep-vs-rate.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    other = tmp_path / "again.json"
    other.write_text(out.read_text())
    assert main(["bench", "compare", str(out), str(other), "--plot", str(tmp_path / "cmp")]) == 0
    assert (tmp_path / "cmp-latency-cdf.png").read_bytes().startswith(b"\x89PNG")


def test_sharegpt_file_and_prefix_groups(live_server, tmp_path: Path) -> None:
    conversations = [
        {
            "conversations": [
                {"from": "human", "value": f"Tell me about item {i}."},
                {"from": "gpt", "value": "x" * (4 * (i + 2))},
            ]
        }
        for i in range(3)
    ] + [{"conversations": [{"from": "human", "value": "no reply"}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    cfg = small_config(live_server.url, endpoint="openai-chat", dataset=str(path), num_requests=5)
    report = run_benchmark(cfg)
    assert report["summary"]["completed"] == 5
    assert {r["output_tokens"] for r in report["requests"]} <= {2, 3, 4}  # the replies' lengths
    grouped = small_config("", shared_prefix_tokens=6, prefix_groups=2, input_tokens=10)
    heads = {tuple(p[:6]) for salt in ("a", "b") for p in random_prompts(grouped, 20, salt)}
    assert len(heads) == 2, "two groups, the same prefixes in every chunk"


def test_grpc_endpoint(live_server) -> None:
    url = f"grpc://127.0.0.1:{live_server.grpc_port}"
    report = run_benchmark(small_config(url, endpoint="grpc", model=MODEL_NAME, num_requests=3))
    s = report["summary"]
    assert s["completed"] == 3 and s["failed"] == 0
    assert s["total_output_tokens"] == 3 * OUTPUT_TOKENS
    assert s["checks"]["prompt_tokens_as_requested"] and s["checks"]["one_event_per_token"]
    with pytest.raises(ValueError, match="--model"):
        run_benchmark(small_config(url, endpoint="grpc"))


def test_lengths_spread_over_the_range(live_server) -> None:
    cfg = small_config(live_server.url, range_ratio=0.5, num_requests=6)
    report = run_benchmark(cfg)
    rows = report["requests"]
    assert report["summary"]["completed"] == 6
    assert all(6 <= r["prompt_tokens"] <= 18 and 4 <= r["output_tokens"] <= 12 for r in rows)
    assert len({r["prompt_tokens"] for r in rows}) > 1, "lengths vary"
    assert report["summary"]["checks"]["output_tokens_as_requested"] is None


def test_a_usage_chunk_without_finish_reason_is_no_token() -> None:
    """LiteLLM ends a stream with the usage in a choice that has no finish_reason."""
    import asyncio

    from zerohop.bench.load_types import StreamTimes
    from zerohop.bench.token_events import read_openai

    async def chunks():
        for text in ("a", "b"):
            yield b'data: {"choices":[{"index":0,"delta":{"content":"%s"}}]}\n\n' % text.encode()
        yield b'data: {"choices":[{"index":0,"delta":{}}],"usage":{"completion_tokens":2}}\n\n'
        yield b"data: [DONE]\n\n"

    stream = StreamTimes(0.0)
    asyncio.run(read_openai(chunks(), stream))
    assert stream.events == stream.output_tokens == 2


def test_chat_prompts_are_fitted_without_count_tokens(live_server) -> None:
    """Behind a server or proxy without count_tokens (LiteLLM's), the usage of one-token
    requests sizes the prompts (not one word per token)."""
    import asyncio
    import threading

    import aiohttp
    from aiohttp import web

    async def forward(request: web.Request) -> web.Response:  # buffers: fine for sizing
        async with aiohttp.ClientSession() as session:
            url, body = live_server.url + request.path, await request.read()
            headers = {"content-type": "application/json"}
            async with session.post(url, data=body, headers=headers) as upstream:
                kind = upstream.content_type
                return web.Response(body=await upstream.read(), status=upstream.status,
                                    content_type=kind)  # fmt: skip

    app = web.Application()
    app.router.add_post("/v1/chat/completions", forward)  # no count_tokens: 404
    loop, started, bound = asyncio.new_event_loop(), threading.Event(), []

    def serve() -> None:
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)  # port 0: the kernel picks a free one
        loop.run_until_complete(site.start())
        bound.append(runner.addresses[0][1])  # the port it got
        started.set()
        loop.run_forever()

    threading.Thread(target=serve, daemon=True).start()
    assert started.wait(60)
    try:
        url = f"http://127.0.0.1:{bound[0]}"
        cfg = small_config(url, endpoint="openai-chat", input_tokens=40)
        cfg.model, cfg.num_requests = MODEL_NAME, 2
        report = run_benchmark(cfg)
    finally:
        loop.call_soon_threadsafe(loop.stop)
    assert report["summary"]["completed"] == 2
    assert all(abs(r["prompt_tokens"] - 40) <= 4 for r in report["requests"])
