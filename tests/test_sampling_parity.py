"""Sampling parity with vLLM: penalties, biases, bans and min_p.

The processed logits are compared, bit for bit, with transformers' logits processors (the
reference vLLM's own tests use) on the same random logits and histories, in batches that
mix rows with and without options; presence and frequency penalties, which transformers
lacks, with vLLM's formula. Then end to end on the tiny model, against transformers'
generate() and through the OpenAI SDK.
"""

from __future__ import annotations

import random
from pathlib import Path

import openai
import pytest
import torch
from transformers import (
    GenerationConfig,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

from tests.fixtures.tiny_models import BOS_ID, EOS_IDS, VOCAB_SIZE, load_hf_model
from tests.live_server import MODEL_NAME, LiveServer
from zerohop import LLM, SamplingParams
from zerohop.engine.base.errors import InvalidRequestError
from zerohop.engine.sample.logits_processors import LogitsProcessors, apply_min_p, check_token_ids
from zerohop.engine.sample.sampler import NO_TOKEN_LEFT, NON_FINITE, Sampler
from zerohop.engine.sched.sequence import Sequence
from zerohop.engine.text.tokenizer import Tokenizer

V = VOCAB_SIZE  # the tiny model's, so the toy tokenizer's ids are in range
EOS = EOS_IDS
NEG_INF = float("-inf")


def seq(prompt: list[int], output: list[int], **options: object) -> Sequence:
    options.setdefault("max_tokens", 64)
    s = Sequence("r", list(prompt), SamplingParams(**options), max_tokens=64)
    s.token_ids += output
    return s


def history(rng: random.Random, n_prompt: int, n_output: int) -> tuple[list[int], list[int]]:
    """Token ids drawn from a small range, so that tokens repeat, within and across parts."""
    draw = lambda n: [rng.randrange(4, 60) for _ in range(n)]  # noqa: E731
    return draw(n_prompt), draw(n_output)


def random_logits(rows: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=gen) * 4


def processed(
    logits: torch.Tensor, seqs: list[Sequence], tokenizer: Tokenizer | None = None
) -> torch.Tensor:
    """The whole batch after the processors: the rows they copied put back into a clone."""
    before = logits.clone()
    rows, out = LogitsProcessors(EOS, tokenizer)(logits, seqs)
    assert torch.equal(logits, before), "the sampler's input logits are never changed"
    full = logits.clone()
    if out is not None:
        full[rows] = out
    return full


def ids(tokens: list[int]) -> torch.Tensor:
    return torch.tensor([tokens], dtype=torch.long)


def check_untouched(got: torch.Tensor, logits: torch.Tensor, rows: list[int]) -> None:
    for i in rows:
        assert torch.equal(got[i], logits[i]), f"row {i} has no option and must be untouched"


def frequency_presence(row: torch.Tensor, output: list[int], freq: float, pres: float):
    """vLLM's (OpenAI's) formula, over the output tokens only."""
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=V).float()
    return row - (freq * counts + pres * (counts > 0))


# -- processors against transformers ----------------------------------------------------------


def test_repetition_penalty_matches_transformers() -> None:
    rng = random.Random(1)
    penalties = [1.3, None, 0.7, 2.0, None, 1.0]
    hists = [history(rng, 20, 8) for _ in penalties]
    seqs = [
        seq(p, o) if r is None else seq(p, o, repetition_penalty=r)
        for (p, o), r in zip(hists, penalties, strict=True)
    ]
    logits = random_logits(len(seqs), 1)
    got = processed(logits, seqs)
    for i, r in enumerate(penalties):
        if r is not None:
            want = RepetitionPenaltyLogitsProcessor(r)(ids(seqs[i].token_ids), logits[i : i + 1])
            assert torch.equal(got[i], want[0]), f"row {i}"
    check_untouched(got, logits, [1, 4, 5])


def test_frequency_and_presence_penalties_follow_vllms_formula() -> None:
    rng = random.Random(2)
    options = [(0.5, 0.0), (0.0, 1.5), (None, None), (-1.0, 2.0), (2.0, -0.5)]
    hists = [history(rng, 15, 12) for _ in options]
    seqs = [
        seq(p, o)
        if f is None
        else seq(p, o, frequency_penalty=f, presence_penalty=pr, repetition_penalty=1.2)
        for (p, o), (f, pr) in zip(hists, options, strict=True)
    ]
    logits = random_logits(len(seqs), 2)
    got = processed(logits, seqs)
    for i, (f, pr) in enumerate(options):
        if f is None:
            continue
        # vLLM's order: the repetition penalty (transformers'), then frequency and presence.
        repeated = RepetitionPenaltyLogitsProcessor(1.2)(ids(seqs[i].token_ids), logits[i : i + 1])
        want = frequency_presence(repeated[0], hists[i][1], f, pr)
        assert torch.equal(got[i], want), f"row {i}"
    check_untouched(got, logits, [2])


def test_penalties_count_output_tokens_only() -> None:
    prompt, output = [7, 7, 8], [9, 9, 9, 10]
    logits = random_logits(1, 3)
    got = processed(logits, [seq(prompt, output, frequency_penalty=1.0, presence_penalty=0.5)])
    delta = logits[0] - got[0]
    assert delta[7] == delta[8] == 0, "prompt tokens are not penalized"
    assert delta[9] == pytest.approx(3.5) and delta[10] == pytest.approx(1.5)
    assert torch.count_nonzero(delta) == 2


@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
def test_min_p_matches_transformers_on_scaled_logits(temperature: float) -> None:
    logits = random_logits(6, 4)
    logits[5] = NEG_INF  # a row a grammar masked: only a few tokens are left
    logits[5, [3, 50, 70, 200]] = torch.tensor([2.0, 1.0, -1.0, 1.9])
    scaled = logits / temperature
    for min_p in (0.01, 0.1, 0.5, 1.0):
        want = MinPLogitsWarper(min_p)(ids([0]), scaled.clone())
        assert torch.equal(apply_min_p(scaled, min_p), want)


def test_min_p_applies_after_temperature() -> None:
    """Every draw is among the tokens min_p keeps at the request's temperature (which keeps
    more than at temperature 1); the sampler divides first, as vLLM does."""
    logits = random_logits(1, 5)[0]
    temperature, min_p = 2.0, 0.3
    probs = torch.softmax(logits / temperature, dim=-1)
    kept = set((probs >= min_p * probs.max()).nonzero().flatten().tolist())
    at_one = torch.softmax(logits, dim=-1)
    assert len(kept) > int((at_one >= min_p * at_one.max()).sum())
    sampler = Sampler(EOS)
    drawn = set()
    for draw in range(300):
        s = seq([1], [], temperature=temperature, min_p=min_p, seed=draw)
        s.generator = torch.Generator().manual_seed(draw)
        drawn.add(sampler(logits[None], [s]).token_ids[0])
    assert drawn <= kept and len(drawn) > 1


def test_logit_bias_matches_transformers() -> None:
    rng = random.Random(6)
    biases = [{5: 3.0, 17: -100.0, 499: 0.5}, None, {0: 100.0}, {511: -2.5, 6: 1.25}]
    seqs = [seq(*history(rng, 4, 3), logit_bias=b) for b in biases]
    logits = random_logits(len(seqs), 6)
    got = processed(logits, seqs)
    for i, bias in enumerate(biases):
        if bias:
            reference = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])
            want = reference(ids(seqs[i].token_ids), logits[i : i + 1])
            assert torch.equal(got[i], want[0]), f"row {i}"
    check_untouched(got, logits, [1])


def test_allowed_token_ids_match_transformers() -> None:
    allowed = [[5, 9, 300], None, [2], [7, 7, 8]]
    seqs = [seq([1, 2], [3], allowed_token_ids=a) for a in allowed]
    logits = random_logits(len(seqs), 7)
    got = processed(logits, seqs)
    for i, keep in enumerate(allowed):
        if keep:
            banned = sorted(set(range(V)) - set(keep))
            want = SuppressTokensLogitsProcessor(banned)(ids([1, 2, 3]), logits[i : i + 1])
            assert torch.equal(got[i], want[0]), f"row {i}"
    check_untouched(got, logits, [1])


def test_min_tokens_matches_transformers() -> None:
    # (output length, min_tokens, stop_token_ids, ignore_eos)
    cases = [(0, 3, [], False), (2, 3, [40], False), (3, 3, [40], False), (1, 5, [41], True)]
    rng = random.Random(8)
    seqs = [
        seq(rng.sample(range(4, 60), 6), rng.sample(range(4, 60), n), **options)
        for n, m, stop, ignore in cases
        for options in [{"min_tokens": m, "stop_token_ids": stop, "ignore_eos": ignore}]
    ]
    logits = random_logits(len(seqs), 8)
    got = processed(logits, seqs)
    for i, (_, m, stop, ignore) in enumerate(cases):
        stops = stop if ignore else [*EOS, *stop]
        reference = MinNewTokensLengthLogitsProcessor(6, m, stops)
        want = reference(ids(seqs[i].token_ids), logits[i : i + 1])
        assert torch.equal(got[i], want[0]), f"row {i}"
    check_untouched(got, logits, [2])  # min_tokens reached: nothing applies any more


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(llama_dir)


def word_variants(tokenizer: Tokenizer, word: str) -> list[list[int]]:
    """The word as is and with a leading space, for words where vLLM bans both."""
    plain = tokenizer.encode(word, add_special_tokens=False)
    spaced = tokenizer.encode(" " + word, add_special_tokens=False)
    assert len(plain) == len(spaced) and plain[0] != spaced[0]
    return [plain, spaced]


def test_bad_words_match_transformers(tokenizer: Tokenizer) -> None:
    words = ["fox", "lazy dog", "the"]
    variants = [v for w in words for v in word_variants(tokenizer, w)]
    rng = random.Random(9)
    tails = [[], variants[0][:-1], variants[1][:-1], variants[2][:-1], variants[3][:2]]
    outputs = [[rng.randrange(4, 60) for _ in range(3)] + tail for tail in tails]
    seqs = [seq([BOS_ID, 5], out, bad_words=words) for out in outputs]
    seqs.insert(2, seq([BOS_ID, 5], outputs[0]))  # no option: untouched
    logits = random_logits(len(seqs), 9)
    got = processed(logits, seqs, tokenizer)
    reference = NoBadWordsLogitsProcessor(variants)
    for i, s in enumerate(seqs):
        if s.params.bad_words:
            # vLLM matches a word's first tokens in the output only: compare on it alone.
            want = reference(ids(s.token_ids[s.num_prompt_tokens :]), logits[i : i + 1])
            assert torch.equal(got[i], want[0]), f"row {i}"
    check_untouched(got, logits, [2])
    assert torch.isinf(got[1]).sum() == 2 + 1, "single-token words, and fox's last token"


def test_bad_words_follow_vllms_tokenization(tokenizer: Tokenizer) -> None:
    """A leading-space variant counts only when it has as many tokens as the word (toy
    tokenizer: " tokens" takes one fewer), and words never match across the prompt's end."""
    plain = tokenizer.encode("tokens", add_special_tokens=False)
    spaced = tokenizer.encode(" tokens", add_special_tokens=False)
    assert len(spaced) == len(plain) - 1
    fox = tokenizer.encode("fox", add_special_tokens=False)
    seqs = [
        seq([5], plain[:-1], bad_words=["tokens"]),
        seq([5], spaced[:-1], bad_words=["tokens"]),
        seq([5, *fox[:-1]], [], bad_words=["fox"]),  # the prefix is the prompt's
        seq([5], [9, *fox[:-1]], bad_words=["  fox"]),  # leading spaces are stripped
    ]
    logits = random_logits(len(seqs), 10)
    banned = [
        row.nonzero().flatten().tolist() for row in processed(logits, seqs, tokenizer).isneginf()
    ]
    assert banned == [[plain[-1]], [], [], [fox[-1]]]


def test_every_option_at_once_in_vllms_order(tokenizer: Tokenizer) -> None:
    rng = random.Random(11)
    fox = tokenizer.encode("fox", add_special_tokens=False)
    options = {
        "allowed_token_ids": [*range(4, 70), fox[-1], *EOS],
        "bad_words": ["fox"],
        "min_tokens": 20,
        "logit_bias": {10: 5.0, 11: -3.0, 99: 50.0},
        "repetition_penalty": 1.4,
        "frequency_penalty": 0.3,
        "presence_penalty": 0.6,
    }
    seqs = []
    for i in range(8):
        prompt, output = history(rng, 12, 9)
        seqs.append(seq(prompt, output + fox[:-1], **options) if i % 2 else seq(prompt, output))
    logits = random_logits(len(seqs), 11)
    got = processed(logits, seqs, tokenizer)
    banned = sorted(set(range(V)) - set(options["allowed_token_ids"]))
    for i in range(1, 8, 2):
        s, row = seqs[i], logits[i : i + 1]
        out = s.token_ids[s.num_prompt_tokens :]
        row = SuppressTokensLogitsProcessor(banned)(ids(s.token_ids), row)
        row = NoBadWordsLogitsProcessor([fox])(ids(out), row)
        row = MinNewTokensLengthLogitsProcessor(12, 20, EOS)(ids(s.token_ids), row)
        bias = [[[t], b] for t, b in options["logit_bias"].items()]
        row = SequenceBiasLogitsProcessor(bias)(ids(s.token_ids), row)
        row = RepetitionPenaltyLogitsProcessor(1.4)(ids(s.token_ids), row)
        want = frequency_presence(row[0], out, 0.3, 0.6)
        assert torch.equal(got[i], want), f"row {i}"
    check_untouched(got, logits, [0, 2, 4, 6])


# -- the sampler ------------------------------------------------------------------------------


def test_no_options_no_copy() -> None:
    seqs = [seq([1, 2], [3]), seq([4], [], temperature=0.5, top_k=3, min_p=0.2)]
    assert LogitsProcessors(EOS)(random_logits(2, 12), seqs) == ([], None)


def test_greedy_takes_the_processed_argmax_and_logprobs_stay_raw() -> None:
    logits = random_logits(2, 13)
    top = int(logits[0].argmax())
    penalized = seq([top], [], temperature=0, repetition_penalty=50.0, logprobs=3)
    plain = seq([top], [], temperature=0, logprobs=3)
    result = Sampler(EOS)(logits, [penalized, plain])
    processed_row = processed(logits, [penalized])[0]
    assert result.token_ids == [int(processed_row.argmax()), int(logits[1].argmax())]
    assert result.token_ids[0] != top
    raw = torch.log_softmax(logits, dim=-1)
    for row in (0, 1):
        chosen, entries = result.logprobs[row]
        assert chosen == pytest.approx(float(raw[row, result.token_ids[row]]))
        assert list(entries) == raw[row].topk(3).indices.tolist()


def test_masked_rows_sample_what_is_left() -> None:
    """A grammar's mask sets -inf in place before sampling: -inf stays -inf through every
    option, and min_p, greedy and sampled rows pick among the tokens left."""
    logits = random_logits(4, 14)
    left = [3, 50, 70, 200]
    logits[:, [t for t in range(V) if t not in left]] = NEG_INF
    options = {"repetition_penalty": 1.5, "presence_penalty": 1.0, "logit_bias": {9: 100.0}}
    seqs = [
        seq([50], [70], temperature=0, **options),
        seq([50], [70], temperature=1.0, min_p=0.5, seed=1, **options),
        seq([50], [70], temperature=1.0, min_p=0.9, top_p=0.5, seed=2),
        seq([50], [], temperature=0),
    ]
    for s in seqs:
        s.generator = torch.Generator().manual_seed(s.params.seed or 0)
    result = Sampler(EOS)(logits, seqs)
    assert result.errors == [None] * 4
    assert all(t in left for t in result.token_ids)
    assert torch.isneginf(processed(logits, seqs)[:, [9, 10]]).all()


def test_rows_with_no_token_left_fail_alone() -> None:
    logits = random_logits(4, 15)
    logits[2] = NEG_INF
    logits[3, 7] = float("nan")
    seqs = [
        seq([5], [], temperature=0, allowed_token_ids=[EOS[0]], min_tokens=2),
        seq([5], [], temperature=1.0, seed=3),
        seq([5], [], temperature=0),
        seq([5], [], temperature=0),
    ]
    result = Sampler(EOS)(logits, seqs)
    assert result.errors == [NO_TOKEN_LEFT, None, NO_TOKEN_LEFT, NON_FINITE]


def test_token_ids_outside_the_vocabulary_are_refused() -> None:
    check_token_ids(SamplingParams(logit_bias={0: 1.0, V - 1: 2.0}, allowed_token_ids=[4]), V)
    for params in (
        SamplingParams(logit_bias={V: 1.0}),
        SamplingParams(logit_bias={-1: 1.0}),
        SamplingParams(allowed_token_ids=[3, V + 10]),
    ):
        with pytest.raises(InvalidRequestError, match="not a token id"):
            check_token_ids(params, V)


# -- end to end on the tiny model -------------------------------------------------------------

PROMPT = [BOS_ID, 17, 230, 45, 99, 310, 12, 77, 401, 8]


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), num_kv_blocks=64, max_num_seqs=8)


def greedy(max_tokens: int = 12, **options: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **options)


def test_engine_matches_transformers_generate(llm: LLM, llama_dir: Path) -> None:
    """Greedy with repetition_penalty and a bias, token for token against generate()
    (which applies them in vLLM's order: the bias, then the penalty)."""
    bias = {int(t): -4.0 for t in greedy_tokens(llm)[:3]}
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=16,
        eos_token_id=None,
        pad_token_id=EOS[1],
        repetition_penalty=1.3,
        sequence_bias=[[[t], b] for t, b in bias.items()],
    )
    with torch.inference_mode():
        want = load_hf_model(llama_dir).generate(ids(PROMPT), generation_config=config)
    got = llm.generate([PROMPT], greedy(16, repetition_penalty=1.3, logit_bias=bias))[0]
    assert got.token_ids == want[0, len(PROMPT) :].tolist()
    assert got.token_ids != greedy_tokens(llm, 16)


def greedy_tokens(llm: LLM, n: int = 12) -> list[int]:
    return llm.generate([PROMPT], greedy(n))[0].token_ids


def test_logit_bias_bans_the_greedy_token(llm: LLM) -> None:
    first = greedy_tokens(llm)[0]
    out = llm.generate([PROMPT], greedy(12, logit_bias={first: -100.0}))[0].token_ids
    assert first not in out


def test_allowed_token_ids_restrict_every_token(llm: LLM) -> None:
    allowed = [20, 21, 22, 300, 301]
    params = [
        greedy(10, allowed_token_ids=allowed),
        SamplingParams(seed=4, max_tokens=10, ignore_eos=True, allowed_token_ids=allowed),
    ]
    for out in llm.generate([PROMPT, PROMPT], params):
        assert len(out.token_ids) == 10 and set(out.token_ids) <= set(allowed)


def test_huge_repetition_penalty_never_repeats(llm: LLM) -> None:
    out = llm.generate([PROMPT], greedy(20, repetition_penalty=1e6))[0].token_ids
    assert not set(out) & set(PROMPT) and len(set(out)) == len(out)


def test_min_tokens_hold_back_stop_tokens(llm: LLM) -> None:
    full = greedy_tokens(llm)
    stop = full[1]
    assert llm.generate([PROMPT], greedy(12, stop_token_ids=[stop]))[0].token_ids == full[:2]
    out = llm.generate([PROMPT], greedy(12, stop_token_ids=[stop], min_tokens=6))[0]
    assert len(out.token_ids) >= 6 and stop not in out.token_ids[:6]


def test_bad_words_are_never_generated(llm: LLM) -> None:
    """A greedy token whose text is a one-token word is never generated once banned."""
    tokenizer = llm.tokenizer

    def one_token_word(token: int) -> bool:
        word = tokenizer.decode([token]).strip()
        return any(
            tokenizer.encode(text, add_special_tokens=False) == [token]
            for text in (word, " " + word)
        )

    token = next(t for t in greedy_tokens(llm) if one_token_word(t))
    word = tokenizer.decode([token]).strip()
    out = llm.generate([PROMPT], greedy(12, bad_words=[word]))[0].token_ids
    assert token not in out


def test_out_of_vocabulary_ids_are_refused_at_add(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="allowed_token_ids"):
        llm.engine.add_request("oov", PROMPT, greedy(4, allowed_token_ids=[V]))
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        llm.engine.add_request("oov", PROMPT, greedy(4, logit_bias={V + 3: 1.0}))


# -- through the OpenAI SDK -------------------------------------------------------------------


def test_openai_sdk_sends_the_options(live_server: LiveServer) -> None:
    """Token 6, all but forced by its bias, is a stop token: alone it ends the answer at
    once; min_tokens holds it back for 3 tokens."""
    sdk = openai.OpenAI(base_url=live_server.url + "/v1", api_key="any", max_retries=0)
    extra = {"min_p": 0.1, "repetition_penalty": 1.2, "stop_token_ids": [6]}
    options = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "max_tokens": 8}
    options["logit_bias"] = {"5": -100, "6": 40}
    messages = [{"role": "user", "content": "hi"}]
    for min_tokens, want in ((0, [1]), (3, [3, 4, 5, 6, 7, 8])):
        body = {**extra, "min_tokens": min_tokens}
        chat = sdk.chat.completions.create(
            model=MODEL_NAME, messages=messages, extra_body=body, **options
        )
        text = sdk.completions.create(model=MODEL_NAME, prompt="Hi", extra_body=body, **options)
        for usage in (chat.usage, text.usage):
            assert usage is not None and usage.completion_tokens in want
