"""Block-quantized weights: layouts, the C++ product kernels, and the engine computing from them.

By default the kernels round activations to int16 per block of 32 where AVX-512 VNNI is there
(within ~2e-5 of dequantize-then-matmul), else expand each block to float32 in registers
(equal up to summation order); a wrong block layout, nibble order, scale or minimum would be
off by tens of percent. With activations rounded to int8 per block (opt-in, llama.cpp's way)
they stay within about 1% of it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tests.fixtures.tiny_gguf import quantize, write_gguf
from tests.fixtures.tiny_models import BOS_ID, build_tiny_model
from zerohop import LLM, SamplingParams
from zerohop.engine import kernels
from zerohop.engine.model.linear import make_quantized_linear
from zerohop.engine.model.quant import (
    PanelRows,
    QuantizedWeight,
    from_gguf_blocks,
    quantize_q8_0,
)

QT = gguf.GGMLQuantizationType


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def default_tolerance() -> float:
    """The default products' relative error bound: 16-bit activations, or float32 ones."""
    return 1e-4 if kernels.load().wide() else 1e-5


def gguf_weight(
    rows: int, cols: int, qtype: str, seed: int = 0
) -> tuple[np.ndarray, QuantizedWeight]:
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    raw = quantize(values, QT[qtype])
    return raw, from_gguf_blocks(raw, qtype, (rows, cols))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_dequantize_as_gguf_does(qtype: str) -> None:
    raw, weight = gguf_weight(40, 96, qtype)
    want = gguf.quants.dequantize(raw, QT[qtype])
    assert weight.kind == ("q8_0" if qtype == "Q8_0" else "q4_1")
    np.testing.assert_allclose(weight.dequantize().numpy(), want, rtol=1e-6, atol=1e-6)
    rows = torch.tensor([7, 0, 39])
    np.testing.assert_allclose(weight.dequantize(rows).numpy(), want[[7, 0, 39]], rtol=1e-6)
    assert weight.nbytes < want.nbytes / 3  # compact: 8.5 or 6 bits a weight, not 32


def test_q8_0_quantizer_stays_within_half_a_step() -> None:
    weight = torch.randn(16, 64)
    quantized = quantize_q8_0(weight)
    step = weight.reshape(16, 2, 32).abs().amax(-1) / 127
    error = (quantized.dequantize() - weight).abs().reshape(16, 2, 32)
    assert bool((error <= step.unsqueeze(-1) * 0.5 + 1e-7).all())
    assert quantized.qs.dtype == torch.int8 and int(quantized.qs.abs().max()) == 127


@contextmanager
def integer_dots(on: bool) -> Iterator[None]:
    """The products' activations rounded to int8 (decode rows) or not, then as they were."""
    ops = kernels.load()
    before = ops.integer_dots()
    ops.set_integer_dots(on)
    try:
        yield
    finally:
        ops.set_integer_dots(before)


@pytest.fixture
def default_activations() -> Iterator[None]:
    """The default products: 16-bit activations with AVX-512 VNNI, float32 ones elsewhere."""
    with integer_dots(False):
        yield


@pytest.fixture
def int8_activations() -> Iterator[None]:
    """The opt-in int8 path (llama.cpp's q8_0 / q8_1 rounding of decode rows)."""
    with integer_dots(True):
        yield


def test_int8_activations_are_not_the_default() -> None:
    # A position must compute the same decoded or prefilled (DESIGN.md, same answer under any
    # load), and prompt rows never round to int8: so decode rows do not either, by default.
    assert not kernels.load().integer_dots()


def product(weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
    ops = kernels.load()
    if weight.kind == "q8_0":
        return ops.q8_0_linear(x, weight.qs, weight.scales)
    return ops.q4_1_linear(x, weight.qs, weight.scales, weight.mins)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("batch", [1, 3, 4, 5, 33])
@pytest.mark.usefixtures("default_activations")
def test_kernel_matches_dequantized_product(qtype: str, batch: int) -> None:
    _, weight = gguf_weight(72, 160, qtype, seed=batch)
    bias = torch.randn(72)
    x = torch.randn(batch, 160)
    want = x @ weight.dequantize().T + bias
    got = make_quantized_linear(weight, bias)(x)
    assert got.shape == (batch, 72) and got.dtype == torch.float32
    assert relative_error(got, want) < default_tolerance()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
@pytest.mark.parametrize("cols", [32, 96, 160, 1536])  # odd block counts end on a lone block
@pytest.mark.usefixtures("default_activations")
def test_default_products_keep_each_blocks_precision(qtype: str, cols: int) -> None:
    # Each block's activations have their own scale: a block of tiny values next to one of
    # huge ones keeps its precision; the 16-bit path did run (it is not exact).
    _, weight = gguf_weight(48, cols, qtype)
    dequantized = weight.dequantize()
    x = torch.randn(3, cols)
    x[:, :32] *= 1e-4
    x[:, 32:64] *= 1e4
    for block in range(cols // 32):
        part = torch.zeros_like(x)
        part[:, 32 * block : 32 * (block + 1)] = x[:, 32 * block : 32 * (block + 1)]
        got, want = product(weight, part), part @ dequantized.T
        assert relative_error(got, want) < default_tolerance(), block
        if kernels.load().wide():
            assert relative_error(got, want) > 1e-8, "the 16-bit path did not run"


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize(("rows", "cols"), [(960, 576), (576, 1536), (40, 32)])
@pytest.mark.parametrize("batch", [1, 2, 4, 5, 9, 33])
@pytest.mark.usefixtures("int8_activations")
def test_integer_dots_track_the_float_product(qtype: str, rows: int, cols: int, batch: int) -> None:
    _, weight = gguf_weight(rows, cols, qtype, seed=batch)
    x = torch.randn(batch, cols)
    want = x @ weight.dequantize().T
    got = product(weight, x)
    assert relative_error(got, want) < 1e-2  # measured ~0.55% on these random matrices
    ops = kernels.load()
    if ops.simd() and (batch <= 4 or cols > 768):  # where int8 is the faster path
        assert relative_error(got, want) > 1e-4, "the int8 path did not run"


@pytest.mark.usefixtures("int8_activations")
def test_integer_dots_round_blocks_of_very_different_scales() -> None:
    # Each block of 32 activations has its own scale: a block of tiny values next to one of
    # huge ones keeps its precision, and a block of zeros gives zeros.
    _, weight = gguf_weight(64, 128, "Q4_1")
    x = torch.randn(1, 128)
    x[0, :32] *= 1e-4
    x[0, 32:64] *= 1e4
    x[0, 64:96] = 0.0
    dequantized = weight.dequantize()
    for block in range(4):
        part = torch.zeros_like(x)
        part[0, 32 * block : 32 * (block + 1)] = x[0, 32 * block : 32 * (block + 1)]
        want = part @ dequantized.T
        got = product(weight, part)
        if block == 2:
            assert torch.equal(got, torch.zeros_like(got))
        else:
            assert relative_error(got, want) < 2e-2


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
@pytest.mark.usefixtures("int8_activations")
def test_rows_with_outliers_keep_float_activations(qtype: str) -> None:
    # One entry 100x the others (an outlier channel): rounding its block to int8 would zero
    # the rest of the block, so that row runs on float32 activations, as with the switch off;
    # the other row is still rounded (the choice is made row by row).
    _, weight = gguf_weight(64, 576, qtype)
    x = torch.randn(2, 576)
    x[1, 7] = 100 * float(x.abs().max())
    rounded = product(weight, x)
    with integer_dots(False):
        exact = product(weight, x)
    assert relative_error(rounded[1], exact[1]) < 1e-6
    assert 1e-5 < relative_error(rounded[0], exact[0]) < 2e-2


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
@pytest.mark.usefixtures("int8_activations")
def test_prompt_rows_keep_float_activations(qtype: str) -> None:
    # A step with prefill chunks marks where its decode rows end: the rows after are prompt
    # rows and multiply float32 activations; the decode rows before are still rounded.
    ops = kernels.load()
    _, weight = gguf_weight(64, 576, qtype)
    x = torch.randn(3, 576)
    with integer_dots(False):
        exact = product(weight, x)
    ops.set_decode_rows(1)
    try:
        mixed = product(weight, x)
    finally:
        ops.set_decode_rows(-1)
    assert relative_error(mixed[1:], exact[1:]) < 1e-6
    assert 1e-5 < relative_error(mixed[0], exact[0]) < 2e-2


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
@pytest.mark.parametrize("cols", [576, 1536])  # eight-row tiles, four-row tiles
@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
def test_a_rows_product_does_not_depend_on_its_batch(qtype: str, cols: int, int8: bool) -> None:
    # Every tile size sums a row in one order, and int8 or float is decided per row: a row
    # alone and the same row among others (one with an outlier) agree to the bit, so a row's
    # numerics never depend on the requests beside it (nor a speculative step's on its 1 + N).
    _, weight = gguf_weight(64, cols, qtype)
    x = torch.randn(33, cols)
    x[3, 100] = 100 * float(x.abs().max())
    with integer_dots(int8):
        alone = [product(weight, x[row : row + 1])[0] for row in range(len(x))]
        for rows in (2, 3, 4, 5, 8, 9, 17, 33):
            together = product(weight, x[:rows])
            for row in range(rows):
                assert torch.equal(together[row], alone[row]), (rows, row)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
@pytest.mark.parametrize("rows", [16, 40, 72])  # whole panels, and a last one part-filled
def test_packed_panels_compute_as_the_row_major_product(qtype: str, rows: int) -> None:
    # The engine packs its weights once (q4_1_pack / q8_0_pack) and multiplies the panels;
    # the row-major entry point packs per call: the same numbers, to the bit.
    ops = kernels.load()
    if not ops.wide():
        pytest.skip("panels need AVX-512 VNNI")
    _, weight = gguf_weight(rows, 160, qtype)
    x = torch.randn(9, 160)
    if qtype == "Q8_0":
        packed = ops.q8_0_pack(weight.qs, weight.scales)
        got = ops.q8_0_panel_linear(x, *packed, rows)
    else:
        packed = ops.q4_1_pack(weight.qs, weight.scales, weight.mins)
        got = ops.q4_1_panel_linear(x, *packed, rows)
    assert got.shape == (9, rows)
    assert torch.equal(got, product(weight, x))
    assert relative_error(got, x @ weight.dequantize().T) < default_tolerance()


@pytest.mark.parametrize("rows", [16, 40])
def test_rows_read_from_panels_equal_the_blocks_rows(rows: int) -> None:
    # A tied embedding looked up from its output layer's q8_0 panels: the same float32 rows.
    ops = kernels.load()
    _, weight = gguf_weight(rows, 96, "Q8_0")
    panels = PanelRows(weight.shape, *ops.q8_0_pack(weight.qs, weight.scales))
    ids = torch.tensor([0, rows - 1, 7, 15, 3, 7])
    assert torch.equal(panels.dequantize(ids), weight.dequantize(ids))


def test_panels_refuse_what_does_not_match_them() -> None:
    ops = kernels.load()
    if not ops.wide():
        pytest.skip("panels need AVX-512 VNNI")
    _, weight = gguf_weight(40, 64, "Q4_1")
    packed = ops.q4_1_pack(weight.qs, weight.scales, weight.mins)
    with pytest.raises(RuntimeError, match="out_features"):
        ops.q4_1_panel_linear(torch.randn(2, 64), *packed, 49)  # three panels hold 33-48
    with pytest.raises(RuntimeError, match="inner dimension"):
        ops.q4_1_panel_linear(torch.randn(2, 96), *packed, 40)
    with pytest.raises(RuntimeError, match="int8"):
        ops.q8_0_panel_linear(torch.randn(2, 64), packed[0], packed[1], 40)


@pytest.mark.parametrize("rows", [4, 17, 31, 130, 1000])
@pytest.mark.usefixtures("default_activations")
def test_products_cover_every_row_when_split_in_chunks(rows: int) -> None:
    # The pool hands out chunks aligned to 16 rows, more than one per thread: every output
    # column must be written once, whatever the row count.
    ops = kernels.load()
    threads = ops.threads()
    ops.set_threads(2)
    try:
        weight = quantize_q8_0(torch.randn(rows, 64))
        for batch in (1, 9):
            x = torch.randn(batch, 64)
            want = x @ weight.dequantize().T
            got = ops.q8_0_linear(x, weight.qs, weight.scales)
            assert relative_error(got, want) < default_tolerance()
    finally:
        ops.set_threads(threads)


def test_kernel_rejects_mismatched_shapes() -> None:
    ops = kernels.load()
    weight = quantize_q8_0(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.q8_0_linear(torch.randn(2, 48), weight.qs[:, :48].contiguous(), weight.scales)
    with pytest.raises(RuntimeError, match="do not match"):
        ops.q8_0_linear(torch.randn(2, 96), weight.qs, weight.scales)


def test_rows_permute_with_their_blocks() -> None:
    _, weight = gguf_weight(8, 64, "Q4_1")
    order = torch.tensor([3, 1, 0, 2, 7, 6, 5, 4])
    assert torch.equal(weight.permute_rows(order).dequantize(), weight.dequantize()[order])


# ------------------------------------------------------------------------------------------
# The engine on quantized weights, against the same weights dequantized to float32
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("quant_hf") / "llama", "llama")


def first_token_logprobs(llm: LLM, prompts: list[list[int]]) -> list[dict[int, float]]:
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5, ignore_eos=True)
    return [out.logprobs[0] for out in llm.generate(prompts, params)]


def engine(path: Path, quantization: str) -> LLM:
    return LLM(str(path), num_kv_blocks=64, quantization=quantization)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
@pytest.mark.usefixtures("default_activations")
def test_engine_computes_from_the_files_blocks(
    tiny_folder: Path, tmp_path: Path, qtype: str
) -> None:
    path = write_gguf(tiny_folder, tmp_path / f"tiny-{qtype}.gguf", qtype)
    quantized, exact = engine(path, "auto"), engine(path, "none")
    # Tied to the output layer: read from its q8_0 panels where the kernels pack them.
    assert isinstance(quantized.engine.model.embed_tokens, QuantizedWeight | PanelRows)
    assert isinstance(exact.engine.model.embed_tokens, torch.Tensor)
    rng = np.random.default_rng(0)
    prompts = [[BOS_ID, *rng.integers(4, 512, size=n).tolist()] for n in (3, 17, 40)]
    for got, want in zip(
        first_token_logprobs(quantized, prompts), first_token_logprobs(exact, prompts), strict=True
    ):
        assert got.keys() == want.keys(), (got, want)
        assert max(abs(got[t] - want[t]) for t in got) < (5e-3 if kernels.load().wide() else 1e-3)
    long_prompt = prompts[-1]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert quantized.generate([long_prompt], greedy)[0].token_ids == (
        exact.generate([long_prompt], greedy)[0].token_ids
    )


def test_q8_0_mode_quantizes_float_weights(tiny_folder: Path) -> None:
    quantized = engine(tiny_folder, "q8_0")
    layer = quantized.engine.model.layers[0]
    assert isinstance(quantized.engine.model.embed_tokens, QuantizedWeight | PanelRows)
    assert layer.qkv_proj.__name__ == "<lambda>"  # a kernel product, not a oneDNN one
    out = quantized.generate([[BOS_ID, 5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].token_ids) >= 1


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_engine_on_int8_activations_stays_close(
    tiny_folder: Path, tmp_path: Path, qtype: str
) -> None:
    path = write_gguf(tiny_folder, tmp_path / f"tiny-{qtype}.gguf", qtype)
    quantized, exact = engine(path, "auto"), engine(path, "none")
    rng = np.random.default_rng(1)
    prompts = [[BOS_ID, *rng.integers(4, 512, size=n).tolist()] for n in (3, 17, 40)]
    for got, want in zip(
        first_token_logprobs(quantized, prompts), first_token_logprobs(exact, prompts), strict=True
    ):
        top = max(want, key=want.get)
        assert top in got and abs(got[top] - want[top]) < 0.1, (got, want)
