"""vLLM's logits processors on a batch: allowed_token_ids, bad_words, min_tokens, logit_bias,
the repetition, frequency and presence penalties, and min_p; and a thinking budget's forced
closing tag (zerohop.engine.sample.thought_budget).

Only the rows whose request set one of these options are copied and processed, each option
as a few tensor ops over those rows: token ids gathered into index tensors, and the
penalties read and written only at the tokens of the history. A batch where no request set
one costs a few attribute checks per row.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np
import torch

from zerohop.engine.base.errors import InvalidRequestError
from zerohop.engine.sample.sampling_params import SamplingParams
from zerohop.engine.sample.thought_budget import ThoughtBudget

NEG_INF = float("-inf")
WORD_CACHE_SIZE = 4096  # tokenized bad words kept (clients tend to resend the same ones)

# A bad word as the token ids that end it: (the tokens before the last, the last).
WordIds = tuple[tuple[int, ...], int]


class History(Protocol):
    """What the processors read of a request (zerohop.engine.sched.sequence.Sequence)."""

    params: SamplingParams
    token_ids: list[int]  # prompt + output
    thought: ThoughtBudget | None

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_output_tokens(self) -> int: ...


class Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Refuse, when the request is added, ids the model has no logit for (as vLLM does);
    at sampling time they would fail the whole batch's batched path."""
    named = (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids))
    for name, ids in named:
        for t in ids or ():
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise InvalidRequestError(
                    f"{name}: {t!r} is not a token id of this model (0 to {vocab_size - 1})"
                )


def is_active(seq: History) -> bool:
    """Whether any option applies to this request's next token (the fast path's test)."""
    p = seq.params
    return bool(
        p.repetition_penalty != 1.0
        or p.presence_penalty
        or p.frequency_penalty
        or p.logit_bias
        or p.bad_words
        or p.allowed_token_ids is not None
        or seq.num_output_tokens < p.min_tokens
        or forced_token(seq) is not None
    )


def forced_token(seq: History) -> int | None:
    """The token a thinking budget forces next (its thought's closing tag), or None."""
    thought = seq.thought
    return None if thought is None else thought.forced_token(seq.token_ids, seq.num_prompt_tokens)


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Ban the tokens less likely than min_p times the most likely one; on logits already
    divided by the temperature, as vLLM (and transformers' MinPLogitsWarper) do."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p
    return logits.masked_fill(probs < threshold, NEG_INF)


class LogitsProcessors:
    """Applies the options in vLLM's order: allowed_token_ids, bad_words, min_tokens,
    logit_bias, then repetition, frequency and presence penalties."""

    def __init__(self, eos_token_ids: Iterable[int] = (), tokenizer: Encoder | None = None):
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        self.tokenizer = tokenizer
        self._word_ids = functools.lru_cache(maxsize=WORD_CACHE_SIZE)(self._tokenize_word)

    def __call__(
        self, logits: torch.Tensor, seqs: Sequence[History]
    ) -> tuple[list[int], torch.Tensor | None]:
        """(rows, their processed logits, float32): the rows some option applies to, copied;
        `logits` itself is left as it is (its logprobs are reported raw)."""
        rows = [i for i, seq in enumerate(seqs) if is_active(seq)]
        if not rows:
            return rows, None
        picked = [seqs[i] for i in rows]
        out = logits.index_select(0, torch.tensor(rows, device=logits.device)).float()
        vocab = out.shape[-1]
        _keep_allowed(out, picked)
        _put(out, [self._banned(seq, vocab) for seq in picked], None)
        biases = [seq.params.logit_bias or {} for seq in picked]
        _put(out, [list(b) for b in biases], [v for b in biases for v in b.values()])
        _repetition_penalty(out, picked)
        _frequency_presence_penalties(out, picked)
        _force(out, picked)
        return rows, out

    def _banned(self, seq: History, vocab: int) -> list[int]:
        p = seq.params
        banned: list[int] = []
        if seq.num_output_tokens < p.min_tokens:  # vLLM: stop ids, and EOS unless ignored
            banned += p.stop_token_ids if p.ignore_eos else [*p.stop_token_ids, *self.eos_token_ids]
        for word in p.bad_words or ():
            banned += [last for prefix, last in self._word_ids(word) if _ends_with(seq, prefix)]
        return [t for t in banned if 0 <= t < vocab]

    def _tokenize_word(self, word: str) -> tuple[WordIds, ...]:
        """vLLM's rule: the word as is, and with a leading space when that gives the same
        number of tokens but another first one (the word inside a text)."""
        if self.tokenizer is None:
            raise RuntimeError("bad_words needs the sampler to have the tokenizer")
        plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        variants = [plain] if plain else []
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            variants.append(spaced)
        return tuple((tuple(ids[:-1]), ids[-1]) for ids in variants)


def _ends_with(seq: History, prefix: tuple[int, ...]) -> bool:
    """Whether the output so far ends with `prefix` (vLLM matches bad words in the output
    only, not across the prompt's end)."""
    k = len(prefix)
    if k == 0:
        return True
    return k <= seq.num_output_tokens and tuple(seq.token_ids[-k:]) == prefix


def _row_index(
    ids: Sequence[Sequence[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index tensors for `ids[row]`, one list of token ids per row."""
    lengths = torch.tensor([len(x) for x in ids])
    rows = torch.repeat_interleave(torch.arange(len(ids)), lengths)
    tokens = torch.from_numpy(np.concatenate([np.asarray(x, dtype=np.int64) for x in ids]))
    return rows.to(device), tokens.to(device)


def _put(out: torch.Tensor, ids: list[list[int]], values: list[float] | None) -> None:
    """Add `values` at (row, ids[row]) in one op, or set -inf there when values is None."""
    if not any(ids):
        return
    index = _row_index(ids, out.device)
    if values is None:
        out.index_put_(index, torch.tensor(NEG_INF, device=out.device))
    else:
        out.index_put_(index, torch.tensor(values, device=out.device), accumulate=True)


def _keep_allowed(out: torch.Tensor, seqs: list[History]) -> None:
    """-inf everywhere but at allowed_token_ids, in the rows that have them."""
    rows = [j for j, seq in enumerate(seqs) if seq.params.allowed_token_ids is not None]
    if not rows:
        return
    allowed = [seqs[j].params.allowed_token_ids or [] for j in rows]
    local, tokens = _row_index(allowed, out.device)
    index = (torch.tensor(rows, device=out.device)[local], tokens)
    kept = out[index]
    out.index_fill_(0, torch.tensor(rows, device=out.device), NEG_INF)
    out.index_put_(index, kept)


def _force(out: torch.Tensor, seqs: list[History]) -> None:
    """Rows whose thinking budget forces a token: that token only, whatever else applied."""
    for j, seq in enumerate(seqs):
        token = forced_token(seq)
        if token is not None:
            out[j].fill_(NEG_INF)
            out[j, token] = 0.0


def _flat_index(ids: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Each (row, token id) of `ids` as an index into the flattened [rows, vocab] logits."""
    rows, tokens = _row_index(ids, device)
    return rows * vocab + tokens


def _repetition_penalty(out: torch.Tensor, seqs: list[History]) -> None:
    """transformers' and vLLM's: a token of the prompt or the output has its logit divided
    by the penalty when positive, else multiplied. Only those entries are read and written:
    the cost follows the history's length, not the vocabulary's."""
    penalties = [seq.params.repetition_penalty for seq in seqs]
    if all(r == 1.0 for r in penalties):
        return
    vocab, flat_out = out.shape[-1], out.view(-1)
    history = [seq.token_ids if r != 1.0 else [] for seq, r in zip(seqs, penalties, strict=True)]
    seen = _flat_index(history, vocab, out.device)  # a repeated token writes one value
    penalty = torch.tensor(penalties, device=out.device)[seen // vocab]
    values = flat_out[seen]
    flat_out[seen] = torch.where(values > 0, values / penalty, values * penalty)


def _frequency_presence_penalties(out: torch.Tensor, seqs: list[History]) -> None:
    """OpenAI's, over output tokens only (as vLLM):
    logits -= frequency_penalty * count + presence_penalty * (count > 0),
    computed only at the tokens whose count is not 0."""
    freq = [seq.params.frequency_penalty for seq in seqs]
    pres = [seq.params.presence_penalty for seq in seqs]
    if not any(freq) and not any(pres):
        return
    vocab, flat_out = out.shape[-1], out.view(-1)
    outputs = [
        seq.token_ids[seq.num_prompt_tokens :] if f or p else []
        for seq, f, p in zip(seqs, freq, pres, strict=True)
    ]
    seen, counts = torch.unique(_flat_index(outputs, vocab, out.device), return_counts=True)
    row = seen // vocab
    f_row = torch.tensor(freq, device=out.device)[row]
    p_row = torch.tensor(pres, device=out.device)[row]
    flat_out[seen] -= f_row * counts + p_row
