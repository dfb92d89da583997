"""Prometheus metrics: `GET /metrics` in the text format, through prometheus-client.

Two sources. The API process records each request once, when it ends
(`GatewayMetrics.request_finished`), and each refusal (`refused`); the engine process's
counters arrive as the `EngineStatsDict` of `await engine.stats()` and are passed to
`render`, which turns them into gauges and counters at scrape time. Other parts of the
server add their own collectors with `register` (the HTTP connection guard's counters,
`zerohop.api.http.guard.GuardMetrics`), so one registry holds every metric `/metrics` shows.

The state is plain dicts and bucket lists under one lock, so recording a request costs a
few microseconds (prometheus-client's `Histogram.observe` takes a lock and scans the buckets
for each value, which for the inter-token histogram is one call per token); custom
collectors turn it into metric families at scrape time, on this object's own
`CollectorRegistry` (never the global default one, so several servers in one process don't
clash), and prometheus-client writes the exposition format.

Besides zerohop's own names, the gauges that the Kubernetes Gateway API Inference
Extension's endpoint picker scrapes from vLLM are exported under vLLM's names and labels
(`vllm:num_requests_waiting`, `vllm:num_requests_running`, `vllm:kv_cache_usage_perc` with
`model_name` and `engine`), so such a deployment routes to zerohop unchanged.
`vllm:kv_cache_usage_perc` is a 0-1 fraction, as vLLM reports it despite the name. With a
`block_size`, `vllm:cache_config_info{block_size,num_gpu_blocks}` (the picker's optional
prefix-cache scorer inputs) is exported as well.

KV-cache usage counts the blocks held by requests only, as vLLM does: a freed
block that still holds a cached prefix is reclaimable at once (LRU), so it is capacity, not
load. (`blocks_in_use` in the engine's stats is exactly that: all blocks less the free
list, which includes cached-but-unreferenced blocks.)

Requests are not labelled by model: the model name in a request is client-controlled (an
unknown one is answered 404), so it would make the series count unbounded; a replica serves
one model, which the vLLM-named gauges carry as `model_name`.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from itertools import pairwise
from typing import TypedDict

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# vLLM's buckets (vllm/v1/metrics/loggers.py), extended downwards where a small model on a
# fast accelerator would otherwise put every observation in the first bucket. Every vLLM
# bound is kept, so dashboards and quantiles written for vLLM read these the same way.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.0025, 0.005,  # below vLLM's first bound
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_VLLM_REQUEST_LATENCY = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, *_VLLM_REQUEST_LATENCY)
QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, *_VLLM_REQUEST_LATENCY)

REFUSAL_REASONS = (
    "rate_limit_requests",
    "rate_limit_input_tokens",
    "rate_limit_output_tokens",
    "concurrency",
    "budget",
    "budget_lease",
    "authentication",
    "permission",
)


class _Histogram:
    """Per-bucket (not cumulative) counts, the last one +Inf; the caller holds the lock."""

    __slots__ = ("bounds", "counts", "les", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        assert list(bounds) == sorted(set(bounds)), bounds
        self.bounds = tuple(float(b) for b in bounds)
        self.les = (*(floatToGoString(b) for b in self.bounds), "+Inf")
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # the first bound >= value
        self.sum += value

    def snapshot(self) -> tuple[list[int], float]:
        return self.counts.copy(), self.sum

    def family(
        self, name: str, documentation: str, snapshot: tuple[list[int], float]
    ) -> HistogramMetricFamily:
        counts, total_sum = snapshot
        buckets: list[tuple[str, float]] = []
        cumulative = 0
        for le, count in zip(self.les, counts, strict=True):
            cumulative += count
            buckets.append((le, cumulative))
        return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=total_sum)


class _Section(Collector):
    """One part of the exposition, so the parts can be rendered (and cached) separately."""

    def __init__(self, collect: Callable[[], Iterator[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterator[Metric]:
        return self._collect()


class EngineCounters(TypedDict):
    """The engine's counters /metrics shows: keys of the engine's `EngineStatsDict`
    (zerohop.engine.base.outputs), which passes here by its keys, unimported."""

    num_running: int
    num_waiting: int
    num_blocks: int
    blocks_in_use: int
    requests_added: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    spec_draft_tokens: int
    spec_accepted_tokens: int


class GatewayMetrics:
    """All of one server's metrics; `render()` is the body of `GET /metrics`.

    Call `request_finished` / `refused` from the event loop (they are thread-safe too).

    The endpoint picker scrapes `/metrics` every 50 ms by default, so `render` stays cheap
    however many tenants there are: the request section (counters and histograms, hundreds
    of lines with many tenants) is re-rendered only if something changed and its last
    rendering is at least `request_metrics_max_age_s` old; the engine section (a dozen
    lines) and the `register`ed collectors are rendered on every call. `self.registry`
    holds them all, uncached.
    """

    def __init__(
        self,
        model_name: str,
        *,
        block_size: int | None = None,
        request_metrics_max_age_s: float = 1.0,
    ) -> None:
        self.model_name = model_name
        self.block_size = block_size
        self.request_metrics_max_age_s = request_metrics_max_age_s
        self._lock = threading.Lock()
        self._version = 0  # bumped by every record, so an unchanged section is not redone
        self._requests: dict[tuple[str, str, str], int] = {}  # (surface, status, tenant)
        self._prompt: dict[str, int] = {}  # tenant -> uncached prompt tokens
        self._cached: dict[str, int] = {}
        self._output: dict[str, int] = {}
        self._refusals: dict[tuple[str, str], int] = {}  # (reason, tenant)
        self._ttft = _Histogram(TTFT_BUCKETS)
        self._itl = _Histogram(ITL_BUCKETS)
        self._e2e = _Histogram(E2E_BUCKETS)
        self._queue = _Histogram(QUEUE_BUCKETS)
        self._engine: EngineCounters | None = None
        self._request_section = _Section(self._collect_requests)
        self._engine_section = _Section(self._collect_engine)
        self._cached_body = b""
        self._cached_version = -1
        self._cached_at = 0.0
        self._live: list[Collector] = []  # registered by `register`: rendered every time
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self._request_section)
        self.registry.register(self._engine_section)

    def register(self, collector: Collector) -> None:
        """Add another source's metrics (the HTTP server's connection guard) to `registry`;
        `render` collects them on every call, after the engine's."""
        self.registry.register(collector)  # refuses names registered before (with describe)
        self._live.append(collector)

    # -- recording (the request path) ------------------------------------------------

    def request_finished(
        self,
        *,
        surface: str,
        status: int,
        tenant: str,
        model: str,
        prompt_tokens: int,
        cached_tokens: int,
        output_tokens: int,
        ttft_s: float | None,
        e2e_s: float,
        queue_s: float | None,
        token_times: Sequence[float] | None,
    ) -> None:
        """Record one request when it ends (any status, streamed or not).

        `prompt_tokens` is the whole prompt, cached part included (the engine's
        `num_prompt_tokens`); the prompt-token counter gets the uncached part.
        `token_times` are monotonic arrival times of each output token: n tokens give n-1
        inter-token observations. `ttft_s` / `queue_s` of None (no token, never queued)
        record nothing. `model` is accepted but not a label (see the module docstring).
        """
        del model
        key = (surface, str(status), tenant)
        uncached = prompt_tokens - cached_tokens if prompt_tokens > cached_tokens else 0
        with self._lock:
            self._version += 1
            self._requests[key] = self._requests.get(key, 0) + 1
            self._prompt[tenant] = self._prompt.get(tenant, 0) + uncached
            self._cached[tenant] = self._cached.get(tenant, 0) + cached_tokens
            self._output[tenant] = self._output.get(tenant, 0) + output_tokens
            if ttft_s is not None:
                self._ttft.observe(ttft_s)
            self._e2e.observe(e2e_s)
            if queue_s is not None:
                self._queue.observe(queue_s)
            if token_times is not None and len(token_times) > 1:
                itl = self._itl
                bounds, counts = itl.bounds, itl.counts
                for a, b in pairwise(token_times):
                    counts[bisect_left(bounds, b - a)] += 1
                itl.sum += token_times[-1] - token_times[0]

    def refused(self, reason: str, tenant: str) -> None:
        """A request turned away before it reached the engine (see REFUSAL_REASONS)."""
        key = (reason, tenant)
        with self._lock:
            self._version += 1
            self._refusals[key] = self._refusals.get(key, 0) + 1

    # -- exposition --------------------------------------------------------------------

    def render(self, engine_stats: EngineCounters | None) -> tuple[bytes, str]:
        """The `/metrics` body and its content type, with the engine's gauges and the
        registered collectors' metrics as of now.

        `engine_stats` is `await engine.stats()` (or its latest_stats). None (the
        engine did not answer) leaves the engine's metrics out rather than report stale
        values; the request metrics are always there. The body is the classic text format
        (what prometheus-client's own handlers send by default), hence its content type.
        """
        now = time.monotonic()
        version = self._version
        if version != self._cached_version and (
            now - self._cached_at >= self.request_metrics_max_age_s or self._cached_version < 0
        ):
            self._cached_body = generate_latest(self._request_section)
            self._cached_version, self._cached_at = version, now
        self._engine = engine_stats
        body = self._cached_body
        if engine_stats is not None:
            body += generate_latest(self._engine_section)
        for collector in self._live:
            body += generate_latest(collector)
        return body, CONTENT_TYPE_PLAIN_0_0_4

    def _collect_requests(self) -> Iterator[Metric]:
        histograms = (
            (self._ttft, "zerohop_time_to_first_token_seconds", "Time to first token."),
            (
                self._itl,
                "zerohop_inter_token_latency_seconds",
                "Time between consecutive output tokens of a request.",
            ),
            (
                self._e2e,
                "zerohop_e2e_request_latency_seconds",
                "Request latency, from arrival to the end of the response.",
            ),
            (
                self._queue,
                "zerohop_request_queue_time_seconds",
                "Time a request waited before the engine first scheduled it.",
            ),
        )
        with self._lock:
            requests = dict(self._requests)
            prompt, cached, output = dict(self._prompt), dict(self._cached), dict(self._output)
            refusals = dict(self._refusals)
            snapshots = [h.snapshot() for h, _, _ in histograms]
        family = CounterMetricFamily(
            "zerohop_requests", "Requests, by surface, status and tenant.",
            labels=("surface", "status", "tenant"),
        )  # fmt: skip
        for labels, value in requests.items():
            family.add_metric(labels, value)
        yield family
        for name, doc, values in (
            ("zerohop_prompt_tokens", "Uncached prompt tokens, by tenant.", prompt),
            ("zerohop_cached_prompt_tokens", "Prompt tokens read from the prefix cache.", cached),
            ("zerohop_output_tokens", "Output tokens, by tenant.", output),
        ):
            family = CounterMetricFamily(name, doc, labels=("tenant",))
            for tenant, value in values.items():
                family.add_metric((tenant,), value)
            yield family
        family = CounterMetricFamily(
            "zerohop_refusals", "Requests refused by a limit, budget, authentication or overload.",
            labels=("reason", "tenant"),
        )  # fmt: skip
        for reason_tenant, value in refusals.items():
            family.add_metric(reason_tenant, value)
        yield family
        for (h, name, doc), snapshot in zip(histograms, snapshots, strict=True):
            yield h.family(name, doc, snapshot)

    def _collect_engine(self) -> Iterator[Metric]:
        s = self._engine
        if s is None:
            return
        running, waiting = s["num_running"], s["num_waiting"]
        num_blocks = s["num_blocks"]
        usage = s["blocks_in_use"] / num_blocks if num_blocks else 0.0
        yield GaugeMetricFamily(
            "zerohop_requests_running", "Requests in the engine's running batch.", value=running
        )
        yield GaugeMetricFamily(
            "zerohop_requests_waiting", "Requests waiting for the engine.", value=waiting
        )
        yield GaugeMetricFamily(
            "zerohop_kv_cache_usage_ratio",
            "KV-cache blocks held by requests / all blocks (0-1; cached free blocks are free).",
            value=usage,
        )
        yield GaugeMetricFamily(
            "zerohop_kv_cache_blocks", "KV-cache blocks in the pool.", value=num_blocks
        )
        yield CounterMetricFamily(
            "zerohop_engine_requests",
            "Requests the engine accepted (computed; a request attached to another is not).",
            value=s.get("requests_added", 0),
        )
        yield CounterMetricFamily(
            "zerohop_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            value=s["prefix_query_tokens"],
        )
        yield CounterMetricFamily(
            "zerohop_prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            value=s["prefix_hit_tokens"],
        )
        for name, doc, count in (
            ("zerohop_spec_decode_draft_tokens", "Tokens proposed by prompt lookup.",
             s.get("spec_draft_tokens", 0)),
            ("zerohop_spec_decode_accepted_tokens", "Proposed tokens the model agreed with.",
             s.get("spec_accepted_tokens", 0)),
        ):  # fmt: skip
            yield CounterMetricFamily(name, doc, value=count)
        # vLLM's names and labels, for the Gateway API Inference Extension's endpoint picker.
        labels, values = ("model_name", "engine"), (self.model_name, "0")
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests in model execution batches.", running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage),
        ):  # fmt: skip
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            yield family
        if self.block_size is not None:
            family = GaugeMetricFamily(
                "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                labels=("block_size", "num_gpu_blocks", "engine"),
            )  # fmt: skip
            family.add_metric((str(self.block_size), str(num_blocks), "0"), 1)
            yield family


class EngineRestartMetrics(Collector):
    """`zerohop_engine_restarts_total`: engine processes started after the first one died
    (`EngineSupervisor.restarts`, every attempt), read at scrape time; `register` it."""

    def __init__(self, restarts: Callable[[], int]) -> None:
        self.restarts = restarts

    def describe(self) -> Iterator[Metric]:  # the name, so a second registration is refused
        return self.collect()

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "zerohop_engine_restarts",
            "Engine processes started after the engine process died.",
            value=self.restarts(),
        )
