"""The engine: the model loaded, the KV pool sized, the scheduler, sampler and constraints
built, then warmed up; requests live as lifecycle.py keeps them and advance by step.py's step.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from zerohop.engine import kernels, omp
from zerohop.engine.base.outputs import RequestDelta
from zerohop.engine.config import EngineConfig
from zerohop.engine.loading.checkpoint import open_checkpoint
from zerohop.engine.model.decoder import CausalLM
from zerohop.engine.model.quant import needs_kernels
from zerohop.engine.runner import ModelRunner
from zerohop.engine.sample.sampler import Sampler
from zerohop.engine.sched.background_share import BackgroundShare
from zerohop.engine.sched.block_pool import BlockPool
from zerohop.engine.sched.fair_share import VTCPolicy
from zerohop.engine.sched.fork import Forks
from zerohop.engine.sched.policy import FCFSPolicy, SchedulingPolicy
from zerohop.engine.sched.prefill_budget import PrefillBudget
from zerohop.engine.sched.scheduler import Scheduler
from zerohop.engine.sched.sequence import Sequence
from zerohop.engine.sched.speculative import Speculator
from zerohop.engine.start_clock import StartClock
from zerohop.engine.step import StepLoop
from zerohop.engine.structured.constraints import Constraints
from zerohop.engine.throughput import ThroughputMeter
from zerohop.engine.warmup import num_kv_blocks, warm_up

log = logging.getLogger(__name__)


class LLMEngine(StepLoop):
    def __init__(
        self,
        model_path: str | Path,
        config: EngineConfig | None = None,
        policy: SchedulingPolicy | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.start_clock = clock = StartClock()
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        checkpoint = open_checkpoint(model_path)
        self.model_config = checkpoint.config()
        self.tokenizer = checkpoint.tokenizer()
        clock.lap("model file and tokenizer")
        device = self.config.resolve_device()
        dtype = self.config.resolve_dtype(device)
        quantization = self.config.quantization
        if device.type != "cpu" or dtype != torch.float32:
            quantization = "none"  # the quantized kernels are float32 CPU ones
        if device.type == "cpu":
            kernels.available()  # built on a first start (~30 s), else loaded from the cache
            clock.lap("CPU kernels")
        weights = checkpoint.weights(keep_quantized=quantization != "none")
        if needs_kernels(weights, quantization) and not kernels.available():
            quantization = "none"
        if device.type == "cpu" and kernels.available():
            kernels.load().set_threads(torch.get_num_threads())
            if not omp.WORKERS_SLEEP:  # torch's spinning workers would starve ours
                torch.set_num_threads(1)
        self.max_model_len = min(
            self.config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )
        self.model = CausalLM(
            self.model_config,
            weights,
            dtype,
            device,
            str(checkpoint.path),
            checkpoint.name_in_file,
            quantization,
            self.max_model_len,
        )
        clock.lap("weights")
        num_blocks = num_kv_blocks(self.config, self.model, self.max_model_len)
        bs = self.config.block_size
        self.pool = BlockPool(num_blocks, bs, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.pool,
            self.config.max_num_seqs,
            self.config.max_num_batched_tokens,
            policy if policy is not None else default_policy(self.config),
            PrefillBudget(self.config.inter_token_target, lambda: self.throughput.step_times),
            BackgroundShare(self.config.background_step_share, lambda: self.throughput.step_times),
        )
        self.throughput = ThroughputMeter()
        self.runner = ModelRunner(self.model, num_blocks, bs, self.config.enforce_eager)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(
            self.model_config.eos_token_ids
        )
        self.sampler = Sampler(self.eos_token_ids, self.tokenizer)
        self.constraints = Constraints(
            self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids)
        )
        self.requests: dict[str, Sequence] = {}
        self.forks = Forks(self.pool, self.runner, self.scheduler, self.requests)
        speculative = self.config.speculative()
        self.speculator = Speculator(speculative, self.pool) if speculative.enabled else None
        self._pending_aborts: list[str] = []
        self._failed_adds: list[RequestDelta] = []  # reported by the next step
        self._failed_steps = 0  # in a row
        self.requests_added = 0
        clock.lap(f"KV cache ({num_blocks} blocks)")
        warm_up(self)
        self.requests_added = 0  # the warm-up's are not the clients'
        clock.lap("warm-up" if self.config.step_times else "warm-up and step-time calibration")


def default_policy(config: EngineConfig) -> SchedulingPolicy:
    if config.scheduling_policy == "fcfs":
        return FCFSPolicy()
    return VTCPolicy(*config.fair_share_token_weights)
