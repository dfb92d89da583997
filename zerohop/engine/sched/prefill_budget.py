"""How many prompt tokens a step may carry beside running decodes: as many as keep the step
within the inter-token target, by the engine's own measured step costs.

A step is one forward pass: every request decoding in it gets its next token only when the
whole step ends. With the full token budget (max_num_batched_tokens, 2,048) a step that
starts a new batch's prompts beside running streams holds their next tokens for as long as
the whole prefill takes: on the default model at 1 thread, 8 prompts of 64 tokens beside 8
streams made one 2.3-4 s step, where a decode step of 8 takes 50-90 ms. So a step that
carries decodes takes prompt tokens only up to what `StepTimes` says fits in
`inter_token_target` after the decodes' own time, and the rest of each prompt follows in the
next steps (chunked prefill). When the decodes alone take (nearly) the target, as on a CPU
where a decode costs about what a prompt token costs, prompts still get `PREFILL_SHARE` of
the decodes' time (a step then takes 1.5 times a decode step), and at least one token: new
requests are slowed, never starved. A step with nothing decoding delays no token, so it
keeps the full budget: prefill throughput is not lost when nobody waits for a token.

Prompts must also keep pace with the work arriving. A fixed share caps the server: with
128-token prompts and 64-token answers, each decode row brings two prompt tokens to compute,
and half a decode step's time covers far fewer, so under load the queue grew and the batch
drained (F32 at 2 threads, 32 streams: TTFT p50 17 s, 74 tok/s, against 4.9 s and 105 tok/s
with no target). `PromptDemand` measures the prompt tokens arriving per output token (decayed
over the last few thousand output tokens), and a step with decodes may carry that many prompt
tokens per decode, up to `MAX_SHARE` of the decodes' time: the prompt work is spread evenly
over the steps instead of starving or arriving as one long step.

The model is measured online (zerohop.engine.sched.step_times, first figures from the start-up
calibration, a prefill of 512 tokens): below the smallest chunk measured, a chunk is taken to
cost that chunk's time per token (`StepCurve.through_origin`), so a first smaller chunk is
tried, recorded at its size, and the next step's budget is read from the corrected curve.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from zerohop.engine.sched.step_times import StepCurve, StepTimes

# Seconds a step with running decodes aims to stay within. benchmarks/arrivals.py, default
# model at 1 thread (a decode step of 8 streams 50-80 ms), against the whole budget beside
# decodes: 0.1 kept inter-token p99 at 1.3x its median but cost 21% of the saturated
# throughput (more steps, each with its fixed cost, and smaller decode batches); 0.2, p99 2.6-
# 3.2x and 3-11%; 0.15, p99 1.2-2.1x and throughput 0.78-1.08x (three runs).
DEFAULT_INTER_TOKEN_TARGET = 0.15
# Prompt time a step with decodes may always carry, per second of its decodes' own time:
# measured on the default model at 1 thread (8 decodes ~75 ms, a prompt token ~7.5 ms), a
# floor of 16 tokens made such steps 2.7x a decode step; half the decodes' time, 1.5x.
PREFILL_SHARE = 0.5
# Prompt time a step with decodes may take to keep pace with arriving prompts, per second of
# its decodes' time: a step then takes at most 2.5 times a decode step, within the 3x
# inter-token p99 the arrivals benchmark aims at.
MAX_SHARE = 1.5
MIN_PREFILL_TOKENS = 1
# Output tokens after which an arrival counts half in `PromptDemand`.
DEMAND_HALF_LIFE = 2048.0


@dataclass(slots=True)
class PromptDemand:
    """Prompt tokens arriving per output token produced, both decayed by output produced.
    Arrivals wait in `pending` until the next step's output, so both enter the sums at once
    (a steady mix of P-token prompts and O-token answers reads exactly P / O)."""

    half_life: float = DEMAND_HALF_LIFE
    prompt: float = 0.0
    output: float = 0.0
    pending: int = 0

    def arrived(self, prompt_tokens: int) -> None:
        self.pending += prompt_tokens

    def produced(self, output_tokens: int) -> None:
        if output_tokens <= 0:
            return
        decay = 0.5 ** (output_tokens / self.half_life)
        self.prompt = self.prompt * decay + self.pending
        self.output = self.output * decay + output_tokens
        self.pending = 0

    def per_output_token(self) -> float:
        """0 before anything is produced: no pace is asked of the first steps."""
        return (self.prompt + self.pending) / self.output if self.output > 0 else 0.0


@dataclass(slots=True)
class PrefillBudget:
    """`target`: seconds (0: no limit, the full budget always); `step_times`: the engine's
    current measurements (a callable, as the engine replaces its meter after warm-up)."""

    target: float
    step_times: Callable[[], StepTimes]
    share: float = PREFILL_SHARE
    max_share: float = MAX_SHARE
    minimum: int = MIN_PREFILL_TOKENS
    demand: PromptDemand = field(default_factory=PromptDemand)

    def tokens(self, decodes: int, limit: int) -> int:
        """Prompt tokens, at most `limit`, that a step with `decodes` decoding requests may
        carry; `limit` itself when nothing decodes, no target is set or nothing is measured."""
        if decodes <= 0 or self.target <= 0 or limit <= 0:
            return limit
        times = self.step_times()
        measured = StepCurve.from_rows(times.prefill.rows())
        if measured is None:
            return limit
        prefill = measured.through_origin()
        decode = StepCurve.from_rows(times.decode.rows())
        decoding = decode(decodes) if decode is not None else 0.0
        spare = max(self.target - decoding, self.share * decoding)
        within = prefill.largest_within(spare, limit)
        pace = math.ceil(self.demand.per_output_token() * decodes)
        if pace > within:
            cap = prefill.largest_within(self.max_share * decoding, limit)
            within = max(within, min(pace, cap))
        return max(min(self.minimum, limit), within)
