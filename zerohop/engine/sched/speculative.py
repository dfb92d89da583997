"""Speculative decoding without a draft model: prompt lookup (vLLM's "ngram" method).

A decoding request whose last few tokens (an n-gram, longest first) appeared earlier in its
prompt or output is proposed the tokens that followed them there: text that quotes its
context (RAG answers, edits of a given text, code) repeats such runs. The step computes the
request's last token and the proposed ones together, each as a decode row of its own (its
position, the keys before it), so the C++ decode step still runs; then the proposal is
checked against the model:

- greedy: a proposed token is kept while it is the argmax of the row before it; the first
  row that disagrees gives its argmax (so the output is the one decoding without
  speculation gives); when all are kept, the last row gives one more;
- sampled: proposed token d is kept with probability p(d) (the draft is deterministic, so
  min(1, p/q) = p(d)); a refused one is replaced by a draw from p without d, renormalised,
  which leaves each token's distribution exactly p (the rejection sampling of Leviathan et
  al. with a one-hot draft).

Only requests that need nothing per token beyond the plain sampler are proposed to: no
grammar, logprobs, penalties, biases, bans, min_tokens or thinking budget.

A proposal the model refuses whole still cost its rows (a step of 1 + N rows costs up to
1.5x a step of one on a quantized model at one stream), so a request whose proposals keep
failing is proposed to less often: after m refusals in a row it waits 2^(m-1) tokens (at
most MAX_BACKOFF) before the next proposal, and any kept token resets it. Text that does not
repeat its context then pays for a proposal now and then, not at every step. A proposal is
also at most one token longer than the previous one kept (the first has one), so a request
pays for long proposals only while long ones are kept.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch

from zerohop.engine.sample.logits_processors import is_active
from zerohop.engine.sample.sampler import probabilities
from zerohop.engine.sched.block_pool import BlockPool
from zerohop.engine.sched.scheduler import ScheduledChunk
from zerohop.engine.sched.sequence import Sequence

METHODS = ("ngram",)
MAX_BACKOFF = 32  # tokens a request waits at most between proposals after refusals


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """vLLM's --speculative-config for the ngram method."""

    num_speculative_tokens: int = 0  # proposed per step; 0: off
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"speculative {name} must be an integer >= 0, got {value!r}")
        if self.num_speculative_tokens > 16:
            raise ValueError("speculative num_speculative_tokens must be at most 16")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative prompt_lookup_min must be >= 1 and <= prompt_lookup_max")

    @property
    def enabled(self) -> bool:
        return self.num_speculative_tokens > 0


def propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest n-gram
    (max_n down to min_n) that ends `tokens`; [] when none occurs."""
    length = len(tokens)
    if k < 1 or length < min_n + 1:
        return []
    # Every n-gram that matches ends on an earlier copy of the last token: find those at
    # once, then extend each match backwards (a step took 0.5 ms comparing every window).
    ends = np.flatnonzero(np.asarray(tokens[:-1], dtype=np.int64) == tokens[-1])
    best_n, best_end = 0, -1
    for end in ends[::-1].tolist():  # latest first: it wins ties
        n, most = 1, min(max_n, end + 1)
        while n < most and tokens[end - n] == tokens[length - 1 - n]:
            n += 1
        if n > best_n:
            best_n, best_end = n, end
            if n == max_n:
                break
    if best_n < min_n:
        return []
    return tokens[best_end + 1 : best_end + 1 + k]


def eligible(seq: Sequence) -> bool:
    p = seq.params
    return (
        seq.num_output_tokens > 0
        and p.grammar is None
        and p.logprobs is None
        and p.thinking_budget is None
        and not is_active(seq)
    )


@dataclass(slots=True)
class SpeculationStats:
    steps: int = 0  # request-steps that carried a proposal
    draft_tokens: int = 0
    accepted_tokens: int = 0


def verify(logits: torch.Tensor, seq: Sequence, draft: list[int]) -> list[int]:
    """The tokens to emit: the kept prefix of `draft`, then one from the model.
    `logits`: [len(draft) + 1, vocab], row i predicting the token after draft[:i]."""
    p = seq.params
    if p.greedy:
        best = logits.argmax(dim=-1).tolist()
        kept = 0
        while kept < len(draft) and best[kept] == draft[kept]:
            kept += 1
        return [*draft[:kept], best[kept]]
    out: list[int] = []
    for i, token in enumerate(draft):
        probs = probabilities(logits[i], p)
        if torch.rand((), generator=seq.generator).item() < probs[token].item():
            out.append(token)
            continue
        probs[token] = 0.0
        return [*out, _draw(probs, seq) if probs.sum().item() > 0 else token]
    return [*out, _draw(probabilities(logits[len(draft)], p), seq)]


def _draw(probs: torch.Tensor, seq: Sequence) -> int:
    return int(torch.multinomial(probs, 1, generator=seq.generator).item())


class Speculator:
    """Proposes tokens to a step's eligible decodes (their blocks allocated for them) and
    keeps the acceptance counts."""

    def __init__(self, config: SpeculativeConfig, pool: BlockPool) -> None:
        self.config = config
        self.pool = pool
        self.stats = SpeculationStats()

    def draft(self, chunks: list[ScheduledChunk]) -> None:
        """Extend each eligible single-token decode by its proposal, in place (the proposed
        tokens are appended to its token_ids until `take_draft`)."""
        cfg = self.config
        for chunk in chunks:
            seq = chunk.seq
            if chunk.num_tokens != 1 or not chunk.completes or not eligible(seq):
                continue
            if seq.num_output_tokens < seq.spec_resume_at:
                continue
            length = min(cfg.num_speculative_tokens, seq.spec_length)
            room = min(length, seq.max_tokens - seq.num_output_tokens - 1)
            draft = propose(seq.token_ids, room, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            if draft and self.pool.allocate(seq, seq.num_computed_tokens + 1 + len(draft)):
                seq.token_ids.extend(draft)
                chunk.num_tokens, chunk.num_draft = 1 + len(draft), len(draft)

    def take_draft(self, chunk: ScheduledChunk) -> list[int]:
        """The chunk's proposal, removed from its sequence's tokens again."""
        tokens = chunk.seq.token_ids
        draft = tokens[len(tokens) - chunk.num_draft :]
        del tokens[len(tokens) - chunk.num_draft :]
        return draft

    def record(self, seq: Sequence, drafted: int, kept: int) -> None:
        """Count a checked proposal, and back `seq` off after refusals (see the module)."""
        self.stats.steps += 1
        self.stats.draft_tokens += drafted
        self.stats.accepted_tokens += kept
        # Each row of a proposal costs: the next one has one token more than this one kept.
        seq.spec_length = kept + 1
        if kept:
            seq.spec_misses = 0
            return
        seq.spec_misses += 1
        wait = min(2 ** (seq.spec_misses - 1), MAX_BACKOFF)
        seq.spec_resume_at = seq.num_output_tokens + wait


def logits_rows(chunks: list[ScheduledChunk]) -> tuple[list[int], list[slice]]:
    """Where the step's logits rows are (in `chunks` order, as the runner returns them): the
    rows of the plain completing chunks, and the block of rows of each speculated one."""
    plain: list[int] = []
    blocks: list[slice] = []
    row = 0
    for chunk in chunks:
        if not chunk.completes:
            continue
        if chunk.num_draft:
            blocks.append(slice(row, row + chunk.num_draft + 1))
            row += chunk.num_draft + 1
        else:
            plain.append(row)
            row += 1
    return plain, blocks


def parse_config(text: str) -> SpeculativeConfig:
    """vLLM's --speculative-config JSON for the ngram method, e.g.
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}."""
    try:
        given = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(given, dict):
        raise ValueError('a JSON object, e.g. {"method": "ngram", "num_speculative_tokens": 4}')
    if given.get("method") not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)} (no draft models here)")
    fields = {k: v for k, v in given.items() if k != "method"}
    known = {"num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
    if unknown := sorted(set(fields) - known):
        raise ValueError(f"unknown key {unknown[0]!r}; known: {', '.join(sorted(known))}")
    if "num_speculative_tokens" not in fields:
        raise ValueError("num_speculative_tokens is required")
    return SpeculativeConfig(**fields)
