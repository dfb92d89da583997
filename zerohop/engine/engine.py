"""The step loop: schedule, run the model, sample, detokenize, report per-request deltas.

One request never ends the loop: a bad value is refused when it is added, and a failure
attributable to one request (a policy hook about it, its sampling row, its detokenizing)
fails that request with an error delta. A failure of the batch as a whole (the forward pass,
a policy hook about the whole queue) fails the requests of that step, whose blocks are freed,
and the loop goes on; only `MAX_FAILED_STEPS` such steps in a row raise (the engine process
then exits, and the API process starts a new one).
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

import torch

from zerohop.engine import kernels, omp
from zerohop.engine.config import EngineConfig
from zerohop.engine.errors import InvalidRequestError
from zerohop.engine.loading.checkpoint import open_checkpoint
from zerohop.engine.model.decoder import CausalLM
from zerohop.engine.model.quant import needs_kernels
from zerohop.engine.outputs import EngineStats, RequestDelta
from zerohop.engine.runner import ModelRunner
from zerohop.engine.sample.logits_processors import check_token_ids
from zerohop.engine.sample.sampler import Sampler, SampleResult
from zerohop.engine.sample.sampling_params import SamplingParams
from zerohop.engine.sample.thought_budget import ThoughtBudget, ThoughtTags
from zerohop.engine.sched.block_pool import BlockPool
from zerohop.engine.sched.fair_share import VTCPolicy
from zerohop.engine.sched.fork import Forks, check_n
from zerohop.engine.sched.policy import FCFSPolicy, SchedulingPolicy, TokenUsage
from zerohop.engine.sched.prefill_budget import PrefillBudget
from zerohop.engine.sched.request_options import check_request_options
from zerohop.engine.sched.scheduler import POLICY_FAILED, ScheduledChunk, Scheduler
from zerohop.engine.sched.sequence import Sequence
from zerohop.engine.sched.speculative import Speculator, logits_rows, verify
from zerohop.engine.structured.constraints import Constraints
from zerohop.engine.text.detokenizer import IncrementalDetokenizer
from zerohop.engine.throughput import ThroughputMeter, quantiles
from zerohop.engine.warmup import num_kv_blocks, warm_up

log = logging.getLogger(__name__)

COMPILE_POLL_SECONDS = 0.005  # an idle step loop's wait for a grammar to compile
MAX_FAILED_STEPS = 8  # steps in a row that failed as a whole: the engine itself is broken
REQUEST_FAILED = "the engine failed while processing this request"
STEP_FAILED = "the engine failed while scheduling the batch this request was in"
# The exception's own text goes to the log, never to the client (it may name internals).
FORWARD_FAILED = "the engine failed while running the batch this request was in"
SAMPLING_FAILED = "the engine failed while sampling this request's next token"


class EngineBrokenError(RuntimeError):
    """Every step fails: no request can be served by this engine any more."""


class LLMEngine:
    def __init__(
        self,
        model_path: str | Path,
        config: EngineConfig | None = None,
        policy: SchedulingPolicy | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        checkpoint = open_checkpoint(model_path)
        self.model_config = checkpoint.config()
        self.tokenizer = checkpoint.tokenizer()
        device = self.config.resolve_device()
        dtype = self.config.resolve_dtype(device)
        quantization = self.config.quantization
        if device.type != "cpu" or dtype != torch.float32:
            quantization = "none"  # the quantized kernels are float32 CPU ones
        weights = checkpoint.weights(keep_quantized=quantization != "none")
        if needs_kernels(weights, quantization) and not kernels.available():
            quantization = "none"
        if device.type == "cpu" and kernels.available():
            kernels.load().set_threads(torch.get_num_threads())
            if not omp.WORKERS_SLEEP:  # torch's spinning workers would starve ours
                torch.set_num_threads(1)
        self.model = CausalLM(
            self.model_config,
            weights,
            dtype,
            device,
            str(checkpoint.path),
            checkpoint.name_in_file,
            quantization,
        )
        self.max_model_len = min(
            self.config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )
        num_blocks = num_kv_blocks(self.config, self.model, self.max_model_len)
        bs = self.config.block_size
        self.pool = BlockPool(num_blocks, bs, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.pool,
            self.config.max_num_seqs,
            self.config.max_num_batched_tokens,
            policy if policy is not None else default_policy(self.config),
            PrefillBudget(self.config.inter_token_target, lambda: self.throughput.step_times),
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
        warm_up(self)

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
        self.requests[request_id] = seq
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

    def step(self) -> list[RequestDelta]:
        return self.forks.relabel(self._step())  # choices of `n` > 1 by their index

    def _step(self) -> list[RequestDelta]:
        deltas = self._apply_aborts() + self._failed_adds + self._admit_constrained()
        self._failed_adds = []
        try:
            plan = self.scheduler.schedule()
        except Exception:  # not one request's fault: the scheduler's every request fails
            log.exception("scheduling failed")
            return deltas + self._step_failed(list(self.requests.values()), STEP_FAILED)
        deltas += [self._fail(seq, seq.error or POLICY_FAILED) for seq in plan.failed]
        if not plan.chunks:
            return deltas
        if self.speculator is not None:
            self.speculator.draft(plan.chunks)
        chunks = ModelRunner.order_chunks(plan.chunks)
        completing = [c.seq for c in chunks if c.completes and not c.num_draft]
        started = time.perf_counter()
        try:
            logits = self.runner.execute(chunks)
        except Exception:  # e.g. out of memory: fail this step's requests, go on
            log.exception("forward pass failed")
            failing = [c.seq for c in chunks]
            return deltas + self._step_failed(failing, FORWARD_FAILED)
        self._failed_steps = 0
        self.scheduler.stepped(plan)
        step_deltas, logits = self._advance_all(chunks, logits)
        logits = self.forks.fork(logits, chunks, completing, step_deltas)
        self.constraints.apply(logits, completing)
        result = self._sample(logits, completing)
        for row, seq in enumerate(completing):
            if not seq.is_finished:  # it may have failed in `_advance`
                self._append_or_fail(seq, row, result, step_deltas[seq.request_id])
        self._charge(chunks, step_deltas)
        decodes = sum(c.num_tokens for c in chunks if c.is_decode)  # rows, proposals too
        self.throughput.record(plan.num_tokens, time.perf_counter() - started, decodes)
        return deltas + list(step_deltas.values())

    def _admit_constrained(self) -> list[RequestDelta]:
        """Schedule the requests whose grammar compiled; with nothing else to run, first
        wait a moment for one (rather than spin the step loop)."""
        if not self.constraints.num_compiling:
            return []
        if not self.scheduler.has_work():
            self.constraints.wait(COMPILE_POLL_SECONDS)
        admitted = self.constraints.admit()
        for seq in admitted.ready:
            self._schedule(seq)
        return [self._fail(seq, message) for seq, message in admitted.failed]

    def _step_failed(self, seqs: list[Sequence], message: str) -> list[RequestDelta]:
        """Fail a whole step's requests (their blocks are freed); raise when steps keep
        failing, so the engine process exits and a fresh one is started."""
        self._failed_steps += 1
        failed = [self._fail(seq, message) for seq in seqs]
        if self._failed_steps >= MAX_FAILED_STEPS:
            raise EngineBrokenError(f"{self._failed_steps} engine steps in a row failed")
        return failed

    def _advance_or_fail(self, chunk: ScheduledChunk) -> RequestDelta:
        try:
            return self._advance(chunk)
        except Exception:
            log.exception("request %s failed after the forward pass", chunk.seq.request_id)
            return self._fail(chunk.seq, REQUEST_FAILED)

    def _advance_all(
        self, chunks: list[ScheduledChunk], logits: torch.Tensor
    ) -> tuple[dict[str, RequestDelta], torch.Tensor]:
        """Each chunk's delta after the forward pass (a speculated one's with its tokens),
        and the logits rows of the plain completing chunks, to sample."""
        speculated = [c for c in chunks if c.num_draft]
        if not speculated:
            return {c.seq.request_id: self._advance_or_fail(c) for c in chunks}, logits
        plain_rows, blocks = logits_rows(chunks)  # before `completes` changes
        deltas = {c.seq.request_id: self._advance_or_fail(c) for c in chunks if not c.num_draft}
        for chunk, rows in zip(speculated, blocks, strict=True):
            deltas[chunk.seq.request_id] = self._verify_or_fail(chunk, logits[rows])
        return deltas, logits[plain_rows]

    def _verify_or_fail(self, chunk: ScheduledChunk, logits: torch.Tensor) -> RequestDelta:
        """A speculated decode: keep what the model agrees with (speculative.verify), then
        append the kept tokens and the model's own as any sampled token is appended."""
        assert self.speculator is not None
        seq = chunk.seq
        delta = RequestDelta(
            seq.request_id,
            num_prompt_tokens=seq.num_prompt_tokens,
            cached_tokens=max(seq.num_cached_tokens, 0),
        )
        try:
            draft = self.speculator.take_draft(chunk)
            tokens = verify(logits, seq, draft)
        except Exception:
            log.exception("request %s failed verifying its proposal", seq.request_id)
            return self._fail(seq, REQUEST_FAILED)
        self.speculator.record(seq, len(draft), len(tokens) - 1)
        seq.num_computed_tokens += 1  # its last token; the kept proposal's K/V once appended
        self.pool.commit(seq)
        result = SampleResult(tokens, [None] * len(tokens), [None] * len(tokens))
        for i in range(len(tokens)):
            self._append_or_fail(seq, i, result, delta)
            if seq.is_finished:
                return delta
        seq.num_computed_tokens += len(tokens) - 1
        return delta

    def _append_or_fail(
        self, seq: Sequence, row: int, result: SampleResult, delta: RequestDelta
    ) -> None:
        try:
            self._append_token(seq, row, result, delta)
        except Exception:  # e.g. detokenizing its token
            log.exception("request %s failed after sampling", seq.request_id)
            self._fail_into(seq, delta, REQUEST_FAILED)

    def _charge(self, chunks: list[ScheduledChunk], deltas: dict[str, RequestDelta]) -> None:
        """Report the step's tokens to the policy; if that fails, request by request, and a
        request the policy cannot charge fails (those charged before may count twice)."""
        policy = self.scheduler.policy
        try:
            return policy.charge([self._usage(c, deltas) for c in chunks])
        except Exception:
            log.exception("the policy's charge failed; charging request by request")
        for c in chunks:
            try:
                policy.charge([self._usage(c, deltas)])
            except Exception:
                log.exception("the policy failed to charge request %s", c.seq.request_id)
                if not c.seq.is_finished:
                    self._fail_into(c.seq, deltas[c.seq.request_id], POLICY_FAILED)

    def _apply_aborts(self) -> list[RequestDelta]:
        deltas = []
        for request_id in self.forks.with_children(self._pending_aborts):
            seq = self.requests.pop(request_id, None)
            if seq is not None:
                self._end(seq, "abort")
                deltas.append(self._final_delta(seq))
        self._pending_aborts.clear()
        return deltas

    def _advance(self, chunk: ScheduledChunk) -> RequestDelta:
        seq = chunk.seq
        # The last token of a completing chunk is a decode once the request has output.
        decoded = 1 if chunk.completes and seq.num_output_tokens > 0 else 0
        prefilled = chunk.num_tokens - decoded
        seq.num_computed_tokens += chunk.num_tokens
        self.pool.commit(seq)
        return RequestDelta(
            seq.request_id,
            num_prompt_tokens=seq.num_prompt_tokens,
            cached_tokens=max(seq.num_cached_tokens, 0),
            prompt_tokens_processed=prefilled,
        )

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        try:
            return self.sampler(logits, seqs)
        except Exception:
            log.exception("batched sampling failed; sampling row by row")
        result = SampleResult([0] * len(seqs), [None] * len(seqs), [None] * len(seqs))
        for row in range(len(seqs)):
            try:
                one = self.sampler(logits[row : row + 1], seqs[row : row + 1])
                result.token_ids[row], result.logprobs[row] = one.token_ids[0], one.logprobs[0]
                result.errors[row] = one.errors[0]
            except Exception:
                log.exception("sampling request %s failed", seqs[row].request_id)
                result.errors[row] = SAMPLING_FAILED
        return result

    def _append_token(
        self, seq: Sequence, row: int, result: SampleResult, delta: RequestDelta
    ) -> None:
        if result.errors[row] is not None:
            return self._fail_into(seq, delta, result.errors[row])
        token = result.token_ids[row]
        seq.token_ids.append(token)
        delta.new_token_ids.append(token)
        if (lp := result.logprobs[row]) is not None:
            delta.new_logprobs = [{**lp[1], token: lp[0]}]
        grammar_done = self.constraints.advance(seq, token)
        text, stop_string = seq.detokenizer.push(token)
        delta.new_text += text  # a speculated step appends several tokens
        reason, stop_reason = self._stop_reason(seq, token, stop_string)
        if grammar_done and reason in (None, "length"):
            reason = "stop"  # the grammar allows nothing more: the answer is complete
        if reason is not None:
            if stop_string is None:
                delta.new_text += seq.detokenizer.flush()
            self.requests.pop(seq.request_id, None)
            self.scheduler.finish(seq, reason, stop_reason)
            seq.matcher = None
            delta.finished, delta.finish_reason, delta.stop_reason = True, reason, stop_reason

    def _stop_reason(
        self, seq: Sequence, token: int, stop_string: str | None
    ) -> tuple[str | None, str | int | None]:
        p = seq.params
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop", None
        if token in p.stop_token_ids:
            return "stop", token
        if stop_string is not None:
            return "stop", stop_string
        if seq.num_output_tokens >= seq.max_tokens:
            return "length", None
        return None, None

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

    @staticmethod
    def _usage(chunk: ScheduledChunk, deltas: dict[str, RequestDelta]) -> TokenUsage:
        d = deltas[chunk.seq.request_id]
        return TokenUsage(
            chunk.seq.request_id,
            chunk.seq.tenant,
            prompt_tokens=d.prompt_tokens_processed,
            output_tokens=len(d.new_token_ids),
            cached_tokens=d.cached_tokens,
        )


def default_policy(config: EngineConfig) -> SchedulingPolicy:
    if config.scheduling_policy == "fcfs":
        return FCFSPolicy()
    return VTCPolicy(*config.fair_share_token_weights)
