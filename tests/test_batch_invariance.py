"""Same answer under any load (DESIGN.md): a request's tokens are a function of the request
alone and its seed, never of the requests sharing its steps, of how its prompt was chunked,
of whether its prefix came from the cache, or of whether its first tokens were decoded here or
replayed as a prompt (a continuation after a failover). On F32, Q8_0 and Q4_1 files, at the
defaults, greedy and seeded, with exact token equality."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import BOS_ID, VOCAB_SIZE
from zerohop import LLM, SamplingParams
from zerohop.engine import kernels

FORMATS = ["F32", "Q8_0", "Q4_1"]
MAX_TOKENS = 24
ENGINE = dict(num_kv_blocks=1024, max_num_seqs=64)


def prompts(count: int = 32) -> list[list[int]]:
    """Lengths 3-160; every fourth prompt shares a 70-token prefix (whole blocks of 16 the
    prefix cache can hand to the next), the rest are their own."""
    rng = random.Random(7)
    shared = [rng.randrange(4, VOCAB_SIZE) for _ in range(70)]
    out = []
    for i in range(count):
        tail = [rng.randrange(4, VOCAB_SIZE) for _ in range(rng.randrange(3, 90))]
        out.append([BOS_ID, *(shared if i % 4 == 0 else []), *tail])
    return out


def sampling(kind: str, i: int) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return SamplingParams(temperature=1.0, top_p=0.9, seed=1000 + i, max_tokens=MAX_TOKENS,
                          ignore_eos=True)  # fmt: skip


@pytest.fixture(scope="module", params=FORMATS)
def model_file(request: pytest.FixtureRequest, llama_dir: Path, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp(f"invariance-{request.param}")
    return str(write_gguf(llama_dir, folder / f"tiny-{request.param}.gguf", request.param))


def alone(llm: LLM, batch: list[list[int]], kind: str) -> list[list[int]]:
    return [llm.generate([p], sampling(kind, i))[0].token_ids for i, p in enumerate(batch)]


def together(llm: LLM, batch: list[list[int]], kind: str) -> list[list[int]]:
    params = [sampling(kind, i) for i in range(len(batch))]
    return [out.token_ids for out in llm.generate(batch, params)]


def staggered(llm: LLM, batch: list[list[int]], kind: str, every: int = 3) -> list[list[int]]:
    """One request more every `every` engine steps, so each joins others mid-decode and its
    prompt shares steps with their decodes (and, with a small token budget, is chunked)."""
    engine, tokens = llm.engine, {f"s{i}": [] for i in range(len(batch))}
    waiting = list(enumerate(batch))
    steps = 0
    while waiting or engine.has_unfinished():
        if waiting and steps % every == 0:
            i, prompt = waiting.pop(0)
            engine.add_request(f"s{i}", prompt, sampling(kind, i))
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.new_token_ids)
        steps += 1
    return [tokens[f"s{i}"] for i in range(len(batch))]


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_alone_together_staggered_and_cached_give_the_same_tokens(
    model_file: str, kind: str
) -> None:
    batch = prompts()
    want = alone(LLM(model_file, **ENGINE, enable_prefix_caching=False), batch, kind)
    assert all(len(t) == MAX_TOKENS for t in want)
    fresh = LLM(model_file, **ENGINE)
    assert together(fresh, batch, kind) == want  # one batched prefill (chunks of 2048)
    assert together(fresh, batch, kind) == want  # again: every prompt from the prefix cache
    # 40-token steps: long prompts split into chunks, beside other requests' decodes.
    chunked = LLM(model_file, **ENGINE, max_num_batched_tokens=40)
    assert staggered(chunked, batch, kind) == want
    eager = LLM(model_file, **ENGINE, enforce_eager=True)  # never the C++ decode step
    assert staggered(eager, batch, kind, every=1) == want


@pytest.mark.parametrize("cached", [True, False], ids=["cached", "recomputed"])
def test_a_continuation_replayed_as_a_prompt_goes_on_as_the_answer_did(
    model_file: str, cached: bool
) -> None:
    # What a failover does: the prompt plus the tokens answered so far, as a new prompt on
    # another engine (cold, or with the prompt's blocks cached); greedy, it must go on with
    # the tokens the uninterrupted answer went on with.
    batch = prompts(8)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [out.token_ids for out in LLM(model_file, **ENGINE).generate(batch, greedy)]
    other = LLM(model_file, **ENGINE, enable_prefix_caching=cached)
    if cached:
        other.generate(batch, SamplingParams(temperature=0.0, max_tokens=1))
    for cut in (1, 7, 16):
        rest = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS - cut, ignore_eos=True)
        replayed = [p + w[:cut] for p, w in zip(batch, want, strict=True)]
        got = [out.token_ids for out in other.generate(replayed, rest)]
        assert got == [w[cut:] for w in want], cut


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    [(6, 2, 64), (9, 3, 64), (4, 4, 128), (2, 1, 32)],  # 32: the untiled per-row path
)
def test_prompt_attention_gives_each_row_the_decode_arithmetic(
    heads: int, kv_heads: int, dim: int
) -> None:
    # Row i of a chunk over the first first_len + i keys equals decode attention of the same
    # query over the same keys, to the bit, for any chunk boundary (rows go in tiles of 8
    # that share each pass over the keys: partial tiles and every offset mod 4 included).
    ops = kernels.load()
    torch.manual_seed(0)
    slots = 300
    k_cache, v_cache = torch.randn(slots, kv_heads, dim), torch.randn(slots, kv_heads, dim)
    key_slots = torch.randperm(slots)[:200].contiguous()
    q = torch.randn(200, heads, dim)
    decoded = torch.empty_like(q)
    lens = torch.arange(1, 201)
    ops.decode_attention(q, k_cache, v_cache, key_slots.expand(200, -1).contiguous(), lens,
                         0.125, decoded, 0)  # fmt: skip
    for start, end in ((0, 200), (0, 37), (37, 38), (38, 200), (150, 199), (65, 130), (3, 12)):
        out = torch.empty(end - start, heads, dim)
        ops.prompt_attention(q[start:end], k_cache, v_cache, key_slots[:end].contiguous(),
                             start + 1, 0.125, out, 0)  # fmt: skip
        assert torch.equal(out, decoded[start:end]), (start, end)


def test_prompt_attention_refuses_slots_that_do_not_cover_the_rows() -> None:
    ops = kernels.load()
    cache = torch.zeros(10, 1, 8)
    with pytest.raises(RuntimeError, match="cover every row"):
        ops.prompt_attention(torch.zeros(4, 1, 8), cache, cache.clone(), torch.arange(3),
                             1, 1.0, torch.empty(4, 1, 8), 0)  # fmt: skip
