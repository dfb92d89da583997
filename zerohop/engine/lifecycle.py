"""A request's life in the engine: added (its values checked), scheduled, aborted, failed or
ended with its final delta; the engine's counters. The step (step.py) moves them on."""

from __future__ import annotations

import functools
import logging

import torch

from zerohop.engine.base.errors import InvalidRequestError
from zerohop.engine.base.outputs import EngineStats, RequestDelta
from zerohop.engine.config import EngineConfig
from zerohop.engine.model.config import ModelConfig
from zerohop.engine.model.decoder import CausalLM
from zerohop.engine.runner import ModelRunner
from zerohop.engine.sample.logits_processors import check_token_ids
from zerohop.engine.sample.sampler import Sampler
from zerohop.engine.sample.sampling_params import SamplingParams
from zerohop.engine.sample.thought_budget import ThoughtBudget, ThoughtTags
from zerohop.engine.sched.block_pool import BlockPool
from zerohop.engine.sched.fork import Forks, check_n
from zerohop.engine.sched.request_options import check_request_options
from zerohop.engine.sched.scheduler import POLICY_FAILED, Scheduler
from zerohop.engine.sched.sequence import Sequence
from zerohop.engine.sched.speculative import Speculator
from zerohop.engine.structured.constraints import Constraints
from zerohop.engine.text.detokenizer import IncrementalDetokenizer
from zerohop.engine.text.tokenizer import Tokenizer
from zerohop.engine.throughput import ThroughputMeter, quantiles

log = logging.getLogger(__name__)

REQUEST_FAILED = "the engine failed while processing this request"


class RequestBook:
    """The requests an engine holds and what happens to each outside the step. The engine
    (engine.py) builds the parts these attributes name."""

    config: EngineConfig
    model_config: ModelConfig
    tokenizer: Tokenizer
    model: CausalLM
    max_model_len: int
    pool: BlockPool
    scheduler: Scheduler
    throughput: ThroughputMeter
    runner: ModelRunner
    eos_token_ids: frozenset[int]
    sampler: Sampler
    constraints: Constraints
    requests: dict[str, Sequence]
    forks: Forks
    speculator: Speculator | None
    _pending_aborts: list[str]
    _failed_adds: list[RequestDelta]
    _failed_steps: int
    requests_added: int  # requests accepted since start (the warm-up's excluded)

    @functools.cached_property
    def thought_tags(self) -> ThoughtTags:
        return ThoughtTags.of(self.tokenizer)

    # -- requests --------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        tenant: str = "default",
        weight: float = 1.0,
        priority: int = 0,
        cache_salt: str | None = None,
        continues: list[int] | None = None,
    ) -> None:
        """`continues`: the prompt ends with these output tokens of an interrupted answer
        (a client's failover); they are not sent again, and the text resumes after them."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        check_request_options(tenant, weight, priority, cache_salt)
        check_token_ids(params, self.model_config.vocab_size)
        check_n(params.n, self.config.max_num_seqs)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            max_tokens=self._resolve_max_tokens(prompt_token_ids, params),
            tenant=tenant,
            weight=weight,
            priority=priority,
            cache_salt=cache_salt,
        )
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.model.device).manual_seed(params.seed)
        seq.detokenizer = IncrementalDetokenizer(
            self.tokenizer, params.stop or [], params.skip_special_tokens
        )
        if params.thinking_budget is not None:
            budget, tags = params.thinking_budget, self.thought_tags
            seq.thought = ThoughtBudget(budget, tags, in_thought=params.thought_open)
        if continues:
            if list(prompt_token_ids[len(prompt_token_ids) - len(continues) :]) != continues:
                raise InvalidRequestError("the prompt must end with the tokens it continues")
            seq.detokenizer.replay(continues)
            if seq.thought is not None:  # the continued tokens spent the budget's start
                seq.thought.forced_token(prompt_token_ids, len(prompt_token_ids) - len(continues))
        self.requests[request_id] = seq
        self.requests_added += 1
        if params.grammar is not None:  # it waits for its grammar, not in the scheduler
            return self.constraints.add(seq, continues)
        self._schedule(seq)

    def _schedule(self, seq: Sequence) -> None:
        request_id = seq.request_id
        try:
            self.scheduler.add(seq)
        except Exception:  # the policy failed on it: this request fails at the next step
            log.exception("scheduling policy failed to add request %s", request_id)
            self._failed_adds.append(self._fail(seq, POLICY_FAILED))

    def _resolve_max_tokens(self, prompt: list[int], params: SamplingParams) -> int:
        n = len(prompt)
        if n == 0:
            raise InvalidRequestError("the prompt is empty: it needs at least one token")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        capacity = min(self.max_model_len, self.pool.num_blocks * self.config.block_size)
        if n >= capacity:
            raise InvalidRequestError(
                f"the prompt has {n} tokens, but this model's context is {capacity} tokens"
                " (prompt plus at least one output token)"
            )
        room = capacity - n
        return room if params.max_tokens is None else min(params.max_tokens, room)

    def prefix_hit(self, request_id: str) -> int:
        """The prompt tokens of a waiting request the prefix cache holds now: what its
        admission will most likely read from the cache (blocks may be evicted meanwhile)."""
        seq = self.requests.get(request_id)
        return 0 if seq is None else len(self.pool.match_prefix(seq)) * self.pool.block_size

    def abort(self, request_id: str) -> None:
        """Takes effect at the next step; unknown or finished ids are ignored."""
        self._pending_aborts.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests or self._failed_adds)

    def background_hold(self) -> float:
        """Seconds to wait before a step of background requests alone (see the scheduler)."""
        if self._failed_adds:
            return 0.0
        return self.scheduler.background_hold(self.config.background_linger)

    def stats(self) -> EngineStats:
        pool = self.pool
        return EngineStats(
            num_blocks=pool.num_blocks,
            blocks_in_use=pool.num_in_use,
            blocks_cached=pool.num_cached,
            blocks_free=pool.num_free,
            prefix_query_tokens=pool.counters.prefix_query_tokens,
            prefix_hit_tokens=pool.counters.prefix_hit_tokens,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.policy),
            requests_added=self.requests_added,
            tokens_per_second=self.throughput.tokens_per_second(),
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_num_seqs=self.config.max_num_seqs,
            block_size=self.config.block_size,
            step_times=self.throughput.step_times.table(),
            step_seconds=self.throughput.last_step_seconds,
            remaining_tokens=quantiles(
                [s.max_tokens - s.num_output_tokens for s in self.scheduler.running]
            ),
            **self._speculation_counts(),
        )

    def _speculation_counts(self) -> dict[str, int]:
        if self.speculator is None:
            return {}
        stats = self.speculator.stats
        return {
            "spec_draft_tokens": stats.draft_tokens,
            "spec_accepted_tokens": stats.accepted_tokens,
        }

    # -- the step --------------------------------------------------------------------

    def _apply_aborts(self) -> list[RequestDelta]:
        deltas = []
        for request_id in self.forks.with_children(self._pending_aborts):
            seq = self.requests.pop(request_id, None)
            if seq is not None:
                self._end(seq, "abort")
                deltas.append(self._final_delta(seq))
        self._pending_aborts.clear()
        return deltas

    def _fail(self, seq: Sequence, message: str) -> RequestDelta:
        self.requests.pop(seq.request_id, None)
        if not seq.is_finished:
            self._end(seq, "error")
        seq.error = message
        return self._final_delta(seq)

    def _end(self, seq: Sequence, reason: str) -> None:
        if self.constraints.discard(seq):  # still compiling: it holds no blocks
            seq.finish(reason)
        else:
            self.scheduler.finish(seq, reason)
        seq.matcher = None

    def _fail_into(self, seq: Sequence, delta: RequestDelta, message: str) -> None:
        """Fail `seq` and make `delta` (its delta of this step) its last."""
        failed = self._fail(seq, message)
        delta.finished, delta.finish_reason, delta.error = True, "error", failed.error

    def _final_delta(self, seq: Sequence) -> RequestDelta:
        return RequestDelta(
            seq.request_id,
            finished=True,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            error=seq.error,
            num_prompt_tokens=seq.num_prompt_tokens,
            cached_tokens=max(seq.num_cached_tokens, 0),
        )
