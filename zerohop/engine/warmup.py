"""An engine's start: how many KV blocks its cache gets, and the warm-up that runs every
code path once and times a batch's steps before the first request."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from zerohop.engine.runner import ModelRunner
from zerohop.engine.sample.sampling_params import SamplingParams
from zerohop.engine.sched.step_times import StepTimes
from zerohop.engine.throughput import ThroughputMeter

if TYPE_CHECKING:
    from zerohop.engine.base.outputs import RequestDelta
    from zerohop.engine.config import EngineConfig
    from zerohop.engine.model.decoder import CausalLM
    from zerohop.engine.sched.block_pool import BlockPool

DEFAULT_CPU_KV_GIB = 1.0
# Start-up times a prefill step of this many prompt tokens (at most the step budget; large
# enough to be compute-bound, so the step-time model extrapolates from it linearly) in this
# many requests, and then their decode step together.
CALIBRATION_TOKENS = 512
CALIBRATION_SEQS = 16


class Engine(Protocol):
    """What the warm-up drives (zerohop.engine.engine.LLMEngine)."""

    config: EngineConfig
    max_model_len: int
    model_config: Any
    pool: BlockPool
    throughput: ThroughputMeter

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> None: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[RequestDelta]: ...


def num_kv_blocks(cfg: EngineConfig, model: CausalLM, max_model_len: int) -> int:
    """Blocks the configured memory holds, and never more than every sequence could use."""
    bs = cfg.block_size
    if cfg.num_kv_blocks:
        return cfg.num_kv_blocks
    per_block = ModelRunner.kv_bytes_per_block(model, bs)
    if cfg.kv_cache_memory is not None:
        budget = cfg.kv_cache_memory * 2**30
    elif model.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(model.device)
        budget = free * cfg.gpu_memory_utilization
    else:
        budget = DEFAULT_CPU_KV_GIB * 2**30
    useful = cfg.max_num_seqs * (-(-max_model_len // bs))
    num_blocks = min(int(budget // per_block), useful)
    if num_blocks < 1:
        raise ValueError(f"KV cache budget {budget / 2**30:.3f} GiB holds no block")
    return num_blocks


def warm_up(engine: Engine) -> None:
    """Run every code path once (prefill, chunk over cache, decode) before serving, then
    time a batch's steps: the queue-wait model's first figures for a burst (see
    zerohop.engine.sched.step_times), measured warm (first runs are slow, so not kept)."""
    length = min(2 * engine.config.block_size + 3, engine.max_model_len - 2)
    _run(engine, {"__warmup__": [1] * length})
    engine.throughput = ThroughputMeter()
    if engine.config.step_times:  # a restart: the earlier start's figures still hold
        engine.throughput.step_times = StepTimes.from_table(engine.config.step_times)
    else:
        _run(engine, _calibration_prompts(engine))
    engine.pool.counters.prefix_query_tokens = engine.pool.counters.prefix_hit_tokens = 0


def _calibration_prompts(engine: Engine) -> dict[str, list[int]]:
    """Prompts that fill one step of up to CALIBRATION_TOKENS prompt tokens, then decode
    together: a prefill step and a decode step at batch CALIBRATION_SEQS, timed warm."""
    cfg = engine.config
    budget = min(cfg.max_num_batched_tokens, CALIBRATION_TOKENS)
    seqs = max(1, min(cfg.max_num_seqs, CALIBRATION_SEQS, budget))
    room = min(engine.max_model_len, engine.pool.num_blocks * cfg.block_size // seqs) - 2
    length = max(1, min(budget // seqs, room - cfg.block_size))
    vocab = engine.model_config.vocab_size
    return {f"__calibrate_{i}__": [(2 + i) % vocab] * length for i in range(seqs)}


def _run(engine: Engine, prompts: dict[str, list[int]]) -> None:
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.error:
                raise RuntimeError(f"warm-up failed: {delta.error}")
