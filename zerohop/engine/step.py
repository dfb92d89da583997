"""The step: schedule, run the model, sample, detokenize, report per-request deltas.

One request never ends the loop: a bad value is refused when it is added, and a failure
attributable to one request (a policy hook about it, its sampling row, its detokenizing)
fails that request with an error delta. A failure of the batch as a whole (the forward pass,
a policy hook about the whole queue) fails the requests of that step, whose blocks are freed,
and the loop goes on; only `MAX_FAILED_STEPS` such steps in a row raise (the engine process
then exits, and the API process starts a new one).
"""

from __future__ import annotations

import logging
import time

import torch

from zerohop.engine.base.outputs import RequestDelta
from zerohop.engine.lifecycle import REQUEST_FAILED, RequestBook
from zerohop.engine.runner import ModelRunner
from zerohop.engine.sample.sampler import SampleResult
from zerohop.engine.sched.policy import TokenUsage
from zerohop.engine.sched.scheduler import POLICY_FAILED, ScheduledChunk
from zerohop.engine.sched.sequence import Sequence
from zerohop.engine.sched.speculative import logits_rows, verify

log = logging.getLogger(__name__)

COMPILE_POLL_SECONDS = 0.005  # an idle step loop's wait for a grammar to compile
MAX_FAILED_STEPS = 8  # steps in a row that failed as a whole: the engine itself is broken
STEP_FAILED = "the engine failed while scheduling the batch this request was in"
# The exception's own text goes to the log, never to the client (it may name internals).
FORWARD_FAILED = "the engine failed while running the batch this request was in"
SAMPLING_FAILED = "the engine failed while sampling this request's next token"


class EngineBrokenError(RuntimeError):
    """Every step fails: no request can be served by this engine any more."""


class StepLoop(RequestBook):
    """One engine step over the requests of the book (lifecycle.py)."""

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
        seconds = time.perf_counter() - started
        self.throughput.record(plan.num_tokens, seconds, decodes)
        self.scheduler.took(seconds)
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
        if (error := result.errors[row]) is not None:
            return self._fail_into(seq, delta, error)
        token = result.token_ids[row]
        seq.token_ids.append(token)
        delta.new_token_ids.append(token)
        if (lp := result.logprobs[row]) is not None:
            delta.new_logprobs = [{**lp[1], token: lp[0]}]
        grammar_done = self.constraints.advance(seq, token)
        detokenizer = seq.detokenizer
        assert detokenizer is not None  # set when the request was added
        text, stop_string = detokenizer.push(token)
        delta.new_text += text  # a speculated step appends several tokens
        reason, stop_reason = self._stop_reason(seq, token, stop_string)
        if grammar_done and reason in (None, "length"):
            reason = "stop"  # the grammar allows nothing more: the answer is complete
        if reason is not None:
            if stop_string is None:
                delta.new_text += detokenizer.flush()
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
