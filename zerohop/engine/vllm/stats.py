"""vLLM's per-step statistics as zerohop's `EngineStats`: what admission, overload refusals,
/metrics and the console read, whichever engine runs.

vLLM hands each step's `SchedulerStats` and `IterationStats` to its stat loggers in the API
process (`AsyncLLM(stat_loggers=...)`); `StepStats` is one, and keeps the latest counters
as the dict `EngineStats` makes. Step times are learned as zerohop's own engine learns them
(zerohop.engine.sched.step_times), from the time between consecutive steps while the engine
is busy: the queue-wait model prices the queue with them on either engine.
"""

from __future__ import annotations

from typing import Any

from vllm.config import VllmConfig
from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerBase
from vllm.v1.metrics.stats import IterationStats, MultiModalCacheStats, SchedulerStats

from zerohop.engine.base.outputs import EngineStats, EngineStatsDict
from zerohop.engine.throughput import ThroughputMeter

# Two steps further apart than this were not back to back (the engine idled between them):
# the gap is not a step's time.
_BUSY_GAP = 2.0


class StepStats:
    """The engine's counters after its latest step, shared with the engine life that made it.

    `latest` is built when read (admission, /metrics, the console), not at every step: vLLM
    calls `record` in the API process once per step, which at one stream is once per token."""

    def __init__(self) -> None:
        self._latest: EngineStatsDict | None = None
        self.requests_added = 0
        self._base: EngineStats | None = None
        self._meter = ThroughputMeter()
        self._last_step: float | None = None

    def configure(self, config: VllmConfig) -> None:
        blocks = int(config.cache_config.num_gpu_blocks or 0)
        self._base = EngineStats(
            num_blocks=blocks,
            blocks_in_use=0,
            blocks_cached=0,
            blocks_free=blocks,
            prefix_query_tokens=0,
            prefix_hit_tokens=0,
            num_running=0,
            num_waiting=0,
            max_num_batched_tokens=int(config.scheduler_config.max_num_batched_tokens or 0),
            max_num_seqs=int(config.scheduler_config.max_num_seqs or 0),
            block_size=int(config.cache_config.block_size or 0),
        )

    @property
    def latest(self) -> EngineStatsDict | None:
        base = self._base
        if base is None:
            return None
        if self._latest is None or base.requests_added != self.requests_added:
            base.requests_added = self.requests_added
            base.tokens_per_second = self._meter.tokens_per_second()
            base.step_times = self._meter.step_times.table()
            self._latest = base.as_dict()
        return self._latest

    def record(self, scheduler: SchedulerStats | None, iteration: IterationStats | None) -> None:
        base = self._base
        if base is None:
            return
        if scheduler is not None:
            self._scheduler(base, scheduler)
        if iteration is not None:
            self._iteration(base, iteration)
        self._latest = None

    def _scheduler(self, base: EngineStats, stats: SchedulerStats) -> None:
        base.num_running, base.num_waiting = stats.num_running_reqs, stats.num_waiting_reqs
        base.blocks_in_use = round(stats.kv_cache_usage * base.num_blocks)
        base.blocks_free = base.num_blocks - base.blocks_in_use
        base.prefix_query_tokens += stats.prefix_cache_stats.queries
        base.prefix_hit_tokens += stats.prefix_cache_stats.hits
        spec = stats.spec_decoding_stats
        if spec is not None:
            base.spec_draft_tokens += spec.num_draft_tokens
            base.spec_accepted_tokens += spec.num_accepted_tokens

    def _iteration(self, base: EngineStats, stats: IterationStats) -> None:
        now = stats.iteration_timestamp
        prompt, decodes = stats.prompt_token_stats.computed, stats.num_generation_tokens
        if self._last_step is not None and 0 < now - self._last_step < _BUSY_GAP:
            seconds = now - self._last_step
            base.step_seconds = seconds
            self._meter.record(prompt + decodes, seconds, decodes)
        self._last_step = now


class StepStatsLogger(StatLoggerBase):
    """The stat logger vLLM calls each step; it feeds one `StepStats`."""

    sink: StepStats  # set on the subclass `logger_factory` makes

    def __init__(self, vllm_config: VllmConfig, engine_index: int = 0) -> None:
        self.sink.configure(vllm_config)

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats: MultiModalCacheStats | None = None,
        engine_idx: int = 0,
    ) -> None:
        self.sink.record(scheduler_stats, iteration_stats)

    def log_engine_initialized(self) -> None:
        pass


class NoPrometheus(PrometheusStatLogger):
    """Stands in for vLLM's Prometheus stat logger, which vLLM adds unless one is given, and
    records nothing. zerohop's /metrics is built from `EngineStats` in its own registry;
    vLLM's logger would fill the process-wide default registry that nobody reads, and its
    per-step counters and histograms were about half of the API process's work at one stream
    (sampled on the tiny model, 2 cores)."""

    def __init__(self, vllm_config: VllmConfig, engine_indexes: list[int] | None = None) -> None:
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_admission_rejection(self, reason: str) -> None:
        pass

    def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass


def logger_factory(sink: StepStats) -> type[StepStatsLogger]:
    """A stat logger class (vLLM's factory signature: `(vllm_config, engine_index)`) that
    feeds `sink`."""
    return type("BoundStepStatsLogger", (StepStatsLogger,), {"sink": sink})
