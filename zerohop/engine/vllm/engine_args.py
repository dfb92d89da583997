"""`zerohop serve --engine vllm`'s options as vLLM's `AsyncEngineArgs`.

zerohop's engine flags that mean the same to vLLM map onto its arguments (--max-num-seqs,
--max-num-batched-tokens, --block-size, --dtype, --max-model-len, --enforce-eager, prefix
caching, n-gram speculation, --kv-cache-memory, --num-kv-blocks, --quantization), vLLM's own
arguments come through `vllm_args` (--tensor-parallel-size, --pipeline-parallel-size,
--gpu-memory-utilization, --kv-events-config, --vllm-arg KEY=VALUE, ...), and zerohop's
scheduling policy rides in vLLM's scheduler as `scheduler_cls`. Structured outputs use vLLM's
guidance (llguidance) backend, the one zerohop's grammars are written for.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm.config import ReasoningConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.platforms import current_platform
from vllm.v1.engine.async_llm import AsyncLLM

from zerohop.engine import omp
from zerohop.engine.base.options import EngineOptions
from zerohop.engine.base.outputs import EngineInfo

SCHEDULER_CLS = "zerohop.engine.vllm.scheduler.FairShareScheduler"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CPU_KV_CACHE_GIB = 1.0  # --kv-cache-memory's default on CPU, as zerohop's engine's


@dataclass(slots=True)
class VllmSetup:
    engine_args: AsyncEngineArgs
    model_dir: Path
    thinking_supported: bool

    @classmethod
    def from_options(cls, model_path: str, options: EngineOptions) -> VllmSetup:
        """Blocking (a GGUF file's first export takes seconds): call it off the loop."""
        from zerohop.models.hf_export import hf_folder_for

        model_dir = hf_folder_for(Path(model_path))
        thinking = _has_think_tokens(model_dir)
        environment = scheduler_environment(options)
        threads = options.get("num_threads")
        if threads:  # vLLM's CPU build binds its threads to these CPUs
            environment["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
        os.environ.update(environment)  # vLLM's EngineCore process inherits it
        omp.vllm_environment()
        try:
            args = AsyncEngineArgs(**engine_arguments(str(model_dir), options, thinking))
        except TypeError as exc:  # a --vllm-arg NAME that is not one of vLLM's
            raise ValueError(f"not an argument of vLLM's engine: {exc}") from None
        return cls(args, model_dir, thinking)

    def info(self, llm: AsyncLLM) -> EngineInfo:
        config = llm.vllm_config
        return {
            "engine": "vllm",
            "vocab_size": config.model_config.get_vocab_size(),
            "max_model_len": config.model_config.max_model_len,
            "block_size": config.cache_config.block_size,
            "model_dir": str(self.model_dir),
        }


def engine_arguments(model_dir: str, options: EngineOptions, thinking: bool) -> dict[str, Any]:
    """AsyncEngineArgs' fields from zerohop's engine options and vLLM's own (`vllm_args`)."""
    args: dict[str, Any] = {
        "model": model_dir,
        "max_num_seqs": options.get("max_num_seqs"),
        "max_num_batched_tokens": options.get("max_num_batched_tokens"),
        "block_size": options.get("block_size"),
        "dtype": options.get("dtype") or "auto",
        "max_model_len": options.get("max_model_len"),
        "enforce_eager": bool(options.get("enforce_eager")),
        "enable_prefix_caching": options.get("enable_prefix_caching", True),
        "num_gpu_blocks_override": options.get("num_kv_blocks"),
        "scheduler_cls": SCHEDULER_CLS,
        "structured_outputs_config": {"backend": "guidance"},
        # vLLM's own loggers off (its Prometheus names come from our /metrics, fed by the
        # stat logger VllmEngine installs, which vLLM then runs alone)
        "disable_log_stats": True,
    }
    memory = options.get("kv_cache_memory")
    if memory is None and current_platform.is_cpu():
        memory = CPU_KV_CACHE_GIB  # vLLM's CPU build would take most of the RAM by default
    if memory:
        args["kv_cache_memory_bytes"] = int(memory * 2**30)
    quantization = options.get("quantization")
    if quantization not in (None, "auto"):
        args["quantization"] = quantization
    if options.get("num_speculative_tokens"):
        args["speculative_config"] = {
            "method": "ngram",
            "num_speculative_tokens": options["num_speculative_tokens"],
            "prompt_lookup_min": options.get("prompt_lookup_min", 2),  # EngineConfig's defaults
            "prompt_lookup_max": options.get("prompt_lookup_max", 4),
        }
    if thinking:
        args["reasoning_config"] = ReasoningConfig(
            reasoning_start_str=THINK_OPEN, reasoning_end_str=THINK_CLOSE
        )
    args = {name: value for name, value in args.items() if value is not None}
    args.update(options.get("vllm_args") or {})
    return args


def scheduler_environment(options: EngineOptions) -> dict[str, str]:
    """The scheduler class's settings, for vLLM's EngineCore process (it inherits them)."""
    from zerohop.engine.vllm import scheduler

    weights = options.get("fair_share_token_weights") or (1.0, 2.0)
    return {
        scheduler.POLICY_ENV: str(options.get("scheduling_policy") or "vtc"),
        scheduler.TOKEN_WEIGHTS_ENV: f"{weights[0]},{weights[1]}",
        scheduler.BACKGROUND_SHARE_ENV: str(options.get("background_step_share", 0.1)),
    }


def _has_think_tokens(model_dir: Path) -> bool:
    """Whether the tokenizer holds <think> and </think> as tokens (thinking budgets)."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return False
    tokenizer = json.loads(path.read_text())
    added = {entry.get("content") for entry in tokenizer.get("added_tokens", [])}
    vocab = tokenizer.get("model", {}).get("vocab", {})
    return all(t in added or t in vocab for t in (THINK_OPEN, THINK_CLOSE))
