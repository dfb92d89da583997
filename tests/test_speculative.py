"""Speculative decoding by prompt lookup (issue 22): proposals from the latest earlier
n-gram, and exactness: greedy output identical to decoding without speculation (the C++
decode step and the eager pass, with stops, max_tokens, n choices and the prefix cache),
and under sampling every emitted token keeps the model's distribution."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.fixtures.tiny_gguf import write_gguf
from tests.live_server import MODEL_NAME, LiveServer
from zerohop import LLM, SamplingParams
from zerohop.engine.config import EngineConfig
from zerohop.engine.sched.sequence import Sequence
from zerohop.engine.sched.speculative import (
    MAX_BACKOFF,
    SpeculativeConfig,
    Speculator,
    propose,
    verify,
)


def test_propose_takes_what_followed_the_latest_longest_ngram() -> None:
    tokens = [5, 6, 7, 1, 2, 5, 6, 7, 3, 4, 9, 6, 7]
    assert propose(tokens, 3, 2, 4) == [3, 4, 9]  # [6, 7] last seen before 3, 4, 9
    assert propose([1, 2, 3, 1, 2, 3, 4, 1, 2, 3], 2, 2, 4) == [4, 1]  # [1, 2, 3] latest
    assert propose([1, 2, 3, 4], 3, 2, 4) == []
    assert propose([1, 2, 1, 2], 5, 2, 2) == [1, 2]  # what is there, up to k
    assert propose([8, 8], 2, 1, 1) == [8]


@pytest.mark.parametrize(
    "fields",
    [
        {"num_speculative_tokens": -1},
        {"num_speculative_tokens": 17},
        {"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
        {"num_speculative_tokens": 2, "prompt_lookup_min": 0},
    ],
)
def test_bad_speculative_configs_are_refused(fields: dict) -> None:
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(**fields)


def _sequence(params: SamplingParams, seed: int) -> Sequence:
    seq = Sequence("r", [1, 2], params, max_tokens=8)
    seq.generator = torch.Generator().manual_seed(seed)
    return seq


def test_verify_keeps_the_model_distribution() -> None:
    # Whatever is proposed, the first emitted token is distributed as the model's p.
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    p = torch.softmax(logits[0], dim=-1)
    params = SamplingParams(temperature=1.0)
    seq = _sequence(params, seed=11)
    for draft in ([0], [2]):
        counts = torch.zeros(4)
        trials = 4000
        for _ in range(trials):
            counts[verify(logits, seq, draft)[0]] += 1
        assert torch.allclose(counts / trials, p, atol=0.03), (draft, counts / trials, p)


def test_verify_greedy_keeps_the_agreeing_prefix() -> None:
    logits = torch.full((4, 10), -1.0)
    for row, best in enumerate([3, 4, 7, 9]):
        logits[row, best] = 5.0
    seq = _sequence(SamplingParams(temperature=0.0), seed=0)
    assert verify(logits, seq, [3, 4, 5]) == [3, 4, 7]
    assert verify(logits, seq, [3, 4, 7]) == [3, 4, 7, 9]
    assert verify(logits, seq, [1, 4, 7]) == [3]


PROMPTS = [
    [7, 8, 9, 10, 7, 8, 9, 11, 12, 7, 8, 9],
    list(range(20, 40)) + list(range(20, 30)),
    [5] * 12,
]


def _run(llm: LLM, params: SamplingParams) -> list[tuple[list[int], str | None]]:
    return [(o.token_ids, o.finish_reason) for o in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module", params=[False, True], ids=["decode-step", "eager"])
def pair(request, llama_dir: Path) -> tuple[LLM, LLM]:
    kw = dict(num_kv_blocks=64, max_num_seqs=8, enforce_eager=request.param)
    return LLM(str(llama_dir), **kw), LLM(str(llama_dir), **kw, num_speculative_tokens=4)


@pytest.mark.parametrize(
    "fields",
    [
        {"max_tokens": 40, "ignore_eos": True},
        {"max_tokens": 7, "ignore_eos": True},
        {"max_tokens": 40, "stop_token_ids": [9, 25]},
        {"max_tokens": 30, "ignore_eos": True, "n": 2},
    ],
)
def test_greedy_output_is_the_same(pair: tuple[LLM, LLM], fields: dict) -> None:
    plain, speculating = pair
    params = SamplingParams(temperature=0.0, **fields)
    before = speculating.engine.speculator.stats.accepted_tokens
    assert _run(speculating, params) == _run(plain, params)
    assert _run(speculating, params) == _run(plain, params)  # now from the prefix cache
    assert speculating.engine.speculator.stats.accepted_tokens > before


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_greedy_output_is_the_same_on_quantized_weights(
    llama_dir: Path, tmp_path: Path, qtype: str
) -> None:
    # int8 activations: a checking step's 1 + N rows must each compute as a row alone does.
    path = str(write_gguf(llama_dir, tmp_path / f"tiny-{qtype}.gguf", qtype))
    kw = dict(num_kv_blocks=64, max_num_seqs=8)
    # 1-grams: proposals on the random model's output too, not only on the prompts' repeats.
    speculating = LLM(path, **kw, num_speculative_tokens=4, prompt_lookup_min=1)
    plain = LLM(path, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    assert _run(speculating, params) == _run(plain, params)
    assert speculating.engine.speculator.stats.steps > 0  # checking steps of 1 + N rows ran


def test_refused_proposals_back_off_and_a_kept_one_resets() -> None:
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=3), pool=None)
    seq = _sequence(SamplingParams(temperature=0.0), seed=0)
    waits = []
    for _ in range(8):
        speculator.record(seq, drafted=3, kept=0)
        waits.append(seq.spec_resume_at - seq.num_output_tokens)
    assert waits == [1, 2, 4, 8, 16, MAX_BACKOFF, MAX_BACKOFF, MAX_BACKOFF]
    speculator.record(seq, drafted=3, kept=1)
    assert seq.spec_misses == 0
    assert seq.spec_length == 2  # the next proposal: one token more than this one kept
    speculator.record(seq, drafted=2, kept=2)
    assert seq.spec_length == 3
    speculator.record(seq, drafted=3, kept=0)
    assert seq.spec_resume_at - seq.num_output_tokens == 1


def test_stop_strings_and_text_are_the_same(pair: tuple[LLM, LLM]) -> None:
    plain, speculating = pair
    free = plain.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=30))[0]
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 2]
    params = SamplingParams(temperature=0.0, max_tokens=30, stop=[stop] if stop.strip() else None)
    a = plain.generate(PROMPTS[1], params)[0]
    b = speculating.generate(PROMPTS[1], params)[0]
    assert (b.text, b.token_ids, b.finish_reason) == (a.text, a.token_ids, a.finish_reason)


def test_sampled_requests_speculate_and_finish(pair: tuple[LLM, LLM]) -> None:
    _, speculating = pair
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=32, ignore_eos=True)
    outputs = speculating.generate(PROMPTS, params)
    assert [len(o.token_ids) for o in outputs] == [32, 32, 32]
    assert all(o.finish_reason == "length" for o in outputs)


def test_a_server_speculates_and_counts_it(
    llama_dir: Path, live_server: LiveServer, tmp_path: Path
) -> None:
    config = '{"method": "ngram", "num_speculative_tokens": 4}'
    server = LiveServer(llama_dir, extra_args=["--speculative-config", config])
    server.start(tmp_path / "server.log")
    try:
        # A run of one token: the lookup proposes from the first decode on.
        kw = dict(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=24, temperature=0.0)
        plain = openai.OpenAI(base_url=live_server.url + "/v1", api_key="x", max_retries=0)
        fast = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        assert fast.completions.create(**kw).choices[0].text == (
            plain.completions.create(**kw).choices[0].text
        )
        metrics = httpx.get(server.url + "/metrics").text
        counts = dict(
            line.split() for line in metrics.splitlines() if line.startswith("zerohop_spec_")
        )
        drafted = float(counts["zerohop_spec_decode_draft_tokens_total"])
        accepted = float(counts["zerohop_spec_decode_accepted_tokens_total"])
        assert drafted > 0 and 0 <= accepted <= drafted
    finally:
        server.stop()
