"""Engine options: dtype, KV cache sizing, context limits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zerohop import LLM, SamplingParams
from zerohop.engine.base.errors import InvalidRequestError
from zerohop.engine.runner import ModelRunner

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_dtypes_load_and_generate(llama_dir: Path, dtype: str) -> None:
    llm = LLM(llama_dir, dtype=dtype, num_kv_blocks=16)
    want = getattr(torch, dtype)
    assert llm.engine.model.embed_tokens.dtype == want
    assert llm.engine.runner.kv_caches[0][0].dtype == want
    out = llm.generate([list(range(5, 30))], GREEDY)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6


def test_auto_dtype_is_float32_on_cpu(llama_dir: Path) -> None:
    llm = LLM(llama_dir, num_kv_blocks=16)
    assert llm.engine.model.embed_tokens.dtype == torch.float32


def test_kv_cache_memory_sizes_the_pool(llama_dir: Path) -> None:
    llm = LLM(llama_dir, kv_cache_memory=0.01, block_size=16)
    per_block = ModelRunner.kv_bytes_per_block(llm.engine.model, 16)
    assert llm.engine.pool.num_blocks == int(0.01 * 2**30 // per_block)
    cache_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in llm.engine.runner.kv_caches)
    assert cache_bytes <= 0.01 * 2**30


def test_prompt_longer_than_context_is_rejected_with_numbers(llama_dir: Path) -> None:
    llm = LLM(llama_dir, num_kv_blocks=16, max_model_len=64)
    with pytest.raises(InvalidRequestError, match=r"70 tokens.*64 tokens"):
        llm.generate([[5] * 70], GREEDY)


def test_max_tokens_is_capped_by_the_context(llama_dir: Path) -> None:
    llm = LLM(llama_dir, num_kv_blocks=16, max_model_len=40)
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    out = llm.generate([[5] * 30], params)[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


@pytest.mark.parametrize(
    "fields",
    [{"temperature": float("nan")}, {"top_p": float("nan")}, {"temperature": float("inf")}],
)
def test_non_finite_sampling_values_are_rejected(fields: dict) -> None:
    with pytest.raises(InvalidRequestError, match="finite"):
        SamplingParams(**fields)
