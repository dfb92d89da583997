"""zerohop's dense GEMM (kernels/dense_gemm.h) against torch's float32 product, and the
engine keeping F16/BF16 matrices at 16 bits.

The kernel multiplies float32 activations with float32, float16 or bfloat16 weights packed
into panels of 16 rows; every 16-bit value widens to float32 exactly, so the product equals
torch's float32 product of the widened matrix up to summation order.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.fixtures.tiny_gguf import hf_gguf_greedy, write_gguf
from tests.fixtures.tiny_models import BOS_ID, build_tiny_model
from zerohop import LLM, SamplingParams
from zerohop.engine import kernels
from zerohop.engine.model.linear import kernel_weight

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.fixture
def two_threads():
    ops = kernels.load()
    threads = ops.threads()
    ops.set_threads(2)
    yield ops
    ops.set_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 97, 200])
def test_matches_the_float32_product(two_threads, dtype: torch.dtype, rows: int) -> None:
    # N = 37: the last panel is partly padding; K = 72 is not a multiple of 32.
    weight = torch.randn(37, 72).to(dtype)
    x = torch.randn(rows, 72)
    got = two_threads.dense_linear(x, two_threads.dense_pack(weight), 37)
    want = x @ weight.float().T
    assert got.shape == (rows, 37)
    assert relative_error(got, want) < 1e-6


@pytest.mark.parametrize("out_features", [16, 33, 300, 1000])
def test_every_output_column_is_written_once(two_threads, out_features: int) -> None:
    # Threads take chunks of panels: every column of every row must come out right.
    weight = torch.randn(out_features, 64)
    x = torch.randn(9, 64)
    got = two_threads.dense_linear(x, two_threads.dense_pack(weight), out_features)
    assert relative_error(got, x @ weight.T) < 1e-6


def test_rejects_weights_that_do_not_match() -> None:
    ops = kernels.load()
    packed = ops.dense_pack(torch.randn(20, 64))
    with pytest.raises(RuntimeError, match="packed"):
        ops.dense_linear(torch.randn(2, 32), packed, 20)
    with pytest.raises(RuntimeError, match="out_features"):
        ops.dense_linear(torch.randn(2, 64), packed, 40)
    with pytest.raises(RuntimeError, match="float32"):
        ops.dense_linear(torch.randn(2, 64).double(), packed, 20)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("dense") / "llama", "llama")


@pytest.mark.parametrize("qtype", ["F16", "BF16"])
def test_sixteen_bit_files_stay_sixteen_bit(
    llama_folder: Path, tmp_path: Path, qtype: str, monkeypatch: pytest.MonkeyPatch
):
    """An F16/BF16 GGUF served as it is (quantization auto): every matrix the kernels hold
    keeps the file's 16-bit type, and greedy decoding matches transformers on the file (the
    exact widening path; test_bf16.py covers BF16's default AVX-512 BF16 product)."""
    monkeypatch.setenv("ZEROHOP_BF16_DOT", "0")
    path = write_gguf(llama_folder, tmp_path / f"tiny-{qtype}.gguf", qtype)
    llm = LLM(str(path), num_kv_blocks=64, max_num_batched_tokens=256)
    model = llm.engine.model
    want_dtype = torch.float16 if qtype == "F16" else torch.bfloat16
    layer = model.layers[0]
    for linear in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
        weight = kernel_weight(linear)
        assert weight is not None and weight.kind == "dense"
        assert weight.tensors[0].dtype == want_dtype
    prompt = [BOS_ID, *range(7, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (out,) = llm.generate([prompt], params)
    assert out.token_ids == hf_gguf_greedy(path, prompt, 8)
