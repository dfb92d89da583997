"""Greedy output of the engine must be token-for-token identical to transformers.

Every tiny architecture runs through each scheduling path (one request at a time,
staggered continuous batching, chunked prefill, prefix-cache hits, preemption under a
tiny KV pool), and each request's ids are compared with transformers' `generate` on the
same weights. `ignore_eos=True` and a fixed `max_tokens` make every length deterministic.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from tests.fixtures import Collected, drive_engine
from tests.fixtures.tiny_models import ARCH_NAMES, BOS_ID, VOCAB_SIZE, hf_greedy
from zerohop import LLM, SamplingParams
from zerohop.engine import kernels

BLOCK_SIZE = 16
MAX_NEW = 10

pytestmark = pytest.mark.parametrize("arch", ARCH_NAMES)


@pytest.fixture
def model_dir(arch: str, tiny_model) -> Path:
    return tiny_model(arch)


def make_llm(folder: Path, **options) -> LLM:
    defaults = {"num_kv_blocks": 128, "max_num_seqs": 16, "block_size": BLOCK_SIZE}
    return LLM(str(folder), **{**defaults, **options})


def random_prompt(rng: random.Random, length: int) -> list[int]:
    """BOS then random ordinary tokens (ids 0-3 are the toy tokenizer's special tokens)."""
    return [BOS_ID] + [rng.randrange(4, VOCAB_SIZE) for _ in range(length - 1)]


def greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def assert_matches_hf(folder: Path, prompt: list[int], got: list[int], label: str) -> None:
    want = hf_greedy(folder, prompt, len(got) or 1)
    assert got == want, f"{label}: prompt of {len(prompt)} tokens diverges from transformers"


def assert_all_match(folder: Path, prompts: dict[str, list[int]], runs: dict[str, Collected]):
    for request_id, prompt in prompts.items():
        run = runs[request_id]
        assert run.finished and run.finish_reason == "length", (request_id, run)
        assert run.error is None
        assert len(run.token_ids) == MAX_NEW
        assert_matches_hf(folder, prompt, run.token_ids, request_id)


def test_single_requests(arch: str, model_dir: Path) -> None:
    llm = make_llm(model_dir)
    rng = random.Random(1)
    for length in (1, 7, 16, 17, 33):
        prompt = random_prompt(rng, length)
        (out,) = llm.generate([prompt], greedy())
        assert out.prompt_token_ids == prompt
        assert out.finish_reason == "length" and len(out.token_ids) == MAX_NEW
        assert_matches_hf(model_dir, prompt, out.token_ids, f"length {length}")


def test_without_the_cpu_kernels(
    arch: str, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The torch-ops path (CUDA, or no C++ compiler): SDPA decode with the key mask."""
    monkeypatch.setattr(kernels, "available", lambda: False)
    llm = make_llm(model_dir)
    assert llm.engine.model.fused_ops is None and llm.engine.model.cache_kernels is None
    rng = random.Random(5)
    prompts = [random_prompt(rng, length) for length in (3, 17, 30)]
    for prompt, out in zip(prompts, llm.generate(prompts, greedy()), strict=True):
        assert len(out.token_ids) == MAX_NEW
        assert_matches_hf(model_dir, prompt, out.token_ids, f"length {len(prompt)}")


class CountingStep:
    """Wraps the runner's C++ decode step, counting the steps it ran."""

    def __init__(self, step) -> None:
        self.step, self.calls = step, 0

    def supports(self, *args) -> bool:
        return self.step.supports(*args)

    def __call__(self, *args):
        self.calls += 1
        return self.step(*args)


def test_decode_steps_run_as_one_cpp_call(arch: str, model_dir: Path) -> None:
    """Decode-only steps of models without q/k norms go through kernels/decode_step.h."""
    llm = make_llm(model_dir)
    runner = llm.engine.runner
    if llm.engine.model_config.qk_norm:
        assert runner.decode_step is None, "q/k norms are not in the C++ step"
        return
    assert runner.decode_step is not None
    runner.decode_step = counting = CountingStep(runner.decode_step)
    rng = random.Random(7)
    prompts = [random_prompt(rng, length) for length in (5, 18, 33)]
    for prompt, out in zip(prompts, llm.generate(prompts, greedy()), strict=True):
        assert_matches_hf(model_dir, prompt, out.token_ids, f"length {len(prompt)}")
    assert counting.calls >= MAX_NEW - 1


def test_enforce_eager_keeps_the_python_pass(arch: str, model_dir: Path) -> None:
    llm = make_llm(model_dir, enforce_eager=True)
    assert llm.engine.runner.decode_step is None
    rng = random.Random(8)
    prompts = [random_prompt(rng, length) for length in (4, 20)]
    for prompt, out in zip(prompts, llm.generate(prompts, greedy()), strict=True):
        assert_matches_hf(model_dir, prompt, out.token_ids, f"length {len(prompt)}")


def test_text_prompt_and_one_batch(arch: str, model_dir: Path) -> None:
    llm = make_llm(model_dir)
    (out,) = llm.generate(["Hello, world! The quick brown fox"], greedy())
    assert out.prompt_token_ids[0] == BOS_ID, "string prompts get the tokenizer's BOS"
    assert out.prompt_token_ids == llm.tokenizer.encode("Hello, world! The quick brown fox")
    assert_matches_hf(model_dir, out.prompt_token_ids, out.token_ids, "text prompt")

    rng = random.Random(2)
    prompts = [random_prompt(rng, n) for n in (3, 40, 12, 1, 25)]
    outs = llm.generate(prompts, greedy())
    assert [o.prompt_token_ids for o in outs] == prompts, "outputs come back in prompt order"
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        assert_matches_hf(model_dir, prompt, out.token_ids, f"batch member {i}")


def test_staggered_arrivals(arch: str, model_dir: Path) -> None:
    """Requests join a running batch at different steps, with mixed prompt lengths."""
    llm = make_llm(model_dir)
    rng = random.Random(3)
    schedule = {0: (5, 30), 3: (18,), 7: (2, 47), 8: (16,), 12: (9,)}
    prompts: dict[str, list[int]] = {}
    arrivals: dict[int, list] = {}
    for step, lengths in schedule.items():
        for length in lengths:
            request_id = f"s{step}-n{length}"
            prompts[request_id] = random_prompt(rng, length)
            arrivals.setdefault(step, []).append((request_id, prompts[request_id], greedy()))
    runs, _ = drive_engine(llm.engine, arrivals)
    assert_all_match(model_dir, prompts, runs)
    assert llm.engine.stats().blocks_in_use == 0


def test_chunked_prefill(arch: str, model_dir: Path) -> None:
    """Prompts longer than the per-step token budget are prefilled over several steps."""
    budget = 32
    llm = make_llm(model_dir, max_num_batched_tokens=budget, max_num_seqs=4)
    rng = random.Random(4)
    prompts = {
        "long": random_prompt(rng, 100),
        "short": random_prompt(rng, 5),
        "mid": random_prompt(rng, 70),
        "late": random_prompt(rng, 45),
    }
    arrivals = {
        0: [("long", prompts["long"], greedy()), ("short", prompts["short"], greedy())],
        2: [("mid", prompts["mid"], greedy())],
        5: [("late", prompts["late"], greedy())],
    }
    runs, _ = drive_engine(llm.engine, arrivals)
    assert_all_match(model_dir, prompts, runs)
    # 100 prompt tokens at most 32 per step: the first output token needs >= 4 steps.
    assert runs["long"].steps_with_tokens[0] >= 3


def test_prefix_cache_hits(arch: str, model_dir: Path) -> None:
    llm = make_llm(model_dir, enable_prefix_caching=True)
    rng = random.Random(5)
    base = random_prompt(rng, 70)
    first = llm.generate([base], greedy())[0]
    assert first.cached_tokens == 0
    assert_matches_hf(model_dir, base, first.token_ids, "first")

    shared = base[:50] + random_prompt(rng, 31)[1:]  # tokens 0..47 are 3 full shared blocks
    same = list(base)  # 69 tokens must be computed at most: 4 full blocks
    aligned = base[:64]  # the last token is always computed, so only 3 blocks can hit
    expected = {"shared": (shared, 48), "same": (same, 64), "aligned": (aligned, 48)}
    hits_before = llm.engine.stats().prefix_hit_tokens
    for label, (prompt, cached) in expected.items():
        out = llm.generate([prompt], greedy())[0]
        assert out.cached_tokens == cached, f"{label}: cached {out.cached_tokens}, want {cached}"
        assert_matches_hf(model_dir, prompt, out.token_ids, label)
    assert llm.engine.stats().prefix_hit_tokens - hits_before == 48 + 64 + 48

    # Prompt + output of the first request, continued (a multi-turn chat): at least the
    # prompt's blocks hit, and the result still matches.
    follow_up = base + first.token_ids + random_prompt(rng, 9)[1:]
    out = llm.generate([follow_up], greedy())[0]
    assert out.cached_tokens >= 64 and out.cached_tokens % BLOCK_SIZE == 0
    assert_matches_hf(model_dir, follow_up, out.token_ids, "follow-up")


def test_cache_salt_isolates_prefixes(arch: str, model_dir: Path) -> None:
    llm = make_llm(model_dir, enable_prefix_caching=True)
    prompt = random_prompt(random.Random(6), 40)
    drive_engine(llm.engine, {0: [("first", prompt, greedy())]})
    salted = ("salted", prompt, greedy(), {"cache_salt": "tenant-b"})
    runs, _ = drive_engine(llm.engine, {0: [salted, ("plain", prompt, greedy())]})
    assert runs["salted"].cached_tokens == 0, "another cache_salt must not reuse these blocks"
    assert runs["plain"].cached_tokens == 32
    for request_id in ("salted", "plain"):
        assert_matches_hf(model_dir, prompt, runs[request_id].token_ids, request_id)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_keeps_outputs_exact(arch: str, model_dir: Path, prefix_caching: bool) -> None:
    """A pool that fits one request's whole sequence plus a block forces preemption.

    Each request needs 2 blocks for its prompt and 4 by its last token; two get admitted
    together, and when both need a third block one of them must be preempted.
    """
    max_new = 40
    num_blocks = 5
    llm = make_llm(
        model_dir, num_kv_blocks=num_blocks, max_num_seqs=4, enable_prefix_caching=prefix_caching
    )
    rng = random.Random(7)
    prompts = {f"r{i}": random_prompt(rng, 20) for i in range(4)}
    params = greedy(max_new)
    arrivals = {0: [(rid, p, params) for rid, p in list(prompts.items())[:3]]}
    arrivals[3] = [("r3", prompts["r3"], params)]
    runs, stats = drive_engine(llm.engine, arrivals)
    for request_id, prompt in prompts.items():
        run = runs[request_id]
        assert run.finish_reason == "length" and len(run.token_ids) == max_new, run
        assert_matches_hf(model_dir, prompt, run.token_ids, request_id)
    assert max(s.blocks_in_use for s in stats) == num_blocks
    assert any(_was_paused(run) for run in runs.values()), "no request was ever preempted"
    assert llm.engine.stats().blocks_in_use == 0


def _was_paused(run: Collected) -> bool:
    """Once decoding, an unpreempted request gets a token every step: a gap is a preemption."""
    steps = run.steps_with_tokens
    return any(b - a > 1 for a, b in itertools.pairwise(steps))
