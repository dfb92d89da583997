"""K-quants (Q4_K, Q5_K, Q6_K) held in their own compact kinds and multiplied as they are.

The blocks come from the tests' reference encoder (tests/fixtures/tiny_gguf.py, checked there
against gguf's dequantizer); here the loaded weights must dequantize exactly as gguf does, stay
within 5% of the file's bytes, and multiply within the default kernels' tolerance of the float
product of the dequantized matrix, on the VNNI panels and on the float path alike, each row
to the bit the same at every row count.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from tests.fixtures.tiny_gguf import K_QUANT_OVERRIDES, load_hf_gguf, quantize, write_gguf
from tests.fixtures.tiny_models import BOS_ID, build_tiny_model
from zerohop import LLM, SamplingParams
from zerohop.engine import kernels
from zerohop.engine.model.kquant import (
    FILE_BYTES,
    KPanelRows,
    KQuantWeight,
    from_gguf_kquant,
    pack_panels,
    tied_panel_rows,
)
from zerohop.engine.model.linear import KernelWeight, kernel_weight, make_quantized_linear
from zerohop.engine.model.quant import QuantizedWeight

QT = gguf.GGMLQuantizationType
# Q5_0 and Q5_1 (what llama-quantize gives rows not a multiple of 256 in Q4_K and Q5_K files)
# are held the same way, with a d (and m) per block of 32.
K_TYPES = ["Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1"]
RESIDENT = {"q4_k": 148, "q5_k": 180, "q6_k": 210, "q5_0": 176, "q5_1": 192}  # per 256 weights


def k_weight(rows: int, cols: int, qtype: str, seed: int = 0) -> tuple[np.ndarray, KQuantWeight]:
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    values[1, :256] = 0.0  # an all-zero super-block
    values[2] = np.abs(values[2]) + 0.5  # all positive: mins of zero
    raw = quantize(values, QT[qtype])
    return raw, from_gguf_kquant(raw, qtype, (rows, cols))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def held_bytes(linear: Any) -> int:
    weight = linear if isinstance(linear, KernelWeight) else kernel_weight(linear)
    assert weight is not None
    return sum(t.numel() * t.element_size() for t in weight.tensors)


def held_parts(linear: Any) -> tuple[KernelWeight, ...]:
    weight = kernel_weight(linear)
    assert weight is not None
    return weight.parts


def paths() -> list[bool]:
    """The VNNI panels where the kernels have them, and always the float path (forced)."""
    return [True, False] if kernels.load().wide() else [False]


@pytest.mark.parametrize("qtype", K_TYPES)
def test_blocks_dequantize_as_gguf_does_and_stay_compact(qtype: str) -> None:
    raw, weight = k_weight(40, 512, qtype)
    want = gguf.quants.dequantize(raw, QT[qtype])
    assert weight.kind == qtype.lower()
    assert np.array_equal(weight.dequantize().numpy(), want)
    rows = torch.tensor([7, 0, 39])
    assert np.array_equal(weight.dequantize(rows).numpy(), want[[7, 0, 39]])
    assert raw.nbytes == 40 * 2 * FILE_BYTES[weight.kind]
    assert weight.nbytes == 40 * 2 * RESIDENT[weight.kind]
    assert weight.nbytes <= 1.05 * raw.nbytes
    # Stacked and permuted as the loader does (fused products, llama's q/k rows).
    order = torch.arange(39, -1, -1)
    both = QuantizedWeight.concat([weight, weight.permute_rows(order)])
    assert np.array_equal(both.dequantize().numpy(), np.concatenate([want, want[::-1]]))


@pytest.mark.parametrize("qtype", K_TYPES)
@pytest.mark.parametrize("rows", [16, 40])  # whole panels, and a last one part-filled
def test_products_match_the_dequantized_float_product(qtype: str, rows: int) -> None:
    _, weight = k_weight(rows, 512, qtype)
    x = torch.randn(9, 512)
    bias = torch.randn(rows)
    want = x.double() @ weight.dequantize().double().T + bias.double()
    for wide in paths():
        linear = make_quantized_linear(weight, bias, wide=wide)
        packed = kernel_weight(linear)
        assert packed is not None and packed.kind == weight.kind + ("_panels" if wide else "")
        # Never widened: the kernels hold the file's bytes (+ the row padding of panels).
        assert held_bytes(linear) <= 1.05 * FILE_BYTES[weight.kind] * (-(-rows // 16) * 16) * 2
        got = linear(x)
        assert got.shape == (9, rows)
        # 16-bit activations on the panels (~2e-5), float32 ones on the float path.
        assert relative_error(got, want) < (1e-4 if wide else 1e-6), (wide, qtype)


@pytest.mark.parametrize("qtype", K_TYPES)
def test_a_rows_product_does_not_depend_on_its_batch(qtype: str) -> None:
    _, weight = k_weight(40, 768, qtype)
    x = torch.randn(17, 768)
    x[3, 100] = 100 * float(x.abs().max())
    for wide in paths():
        linear = make_quantized_linear(weight, None, wide=wide)
        alone = [linear(x[row : row + 1])[0] for row in range(len(x))]
        for count in (1, 3, 8, 17):
            together = linear(x[:count])
            for row in range(count):
                assert torch.equal(together[row], alone[row]), (wide, count, row)


@pytest.mark.parametrize("qtype", K_TYPES)
def test_rows_read_from_panels_equal_the_blocks_rows(qtype: str) -> None:
    # A tied embedding looked up from its output layer's panels: the same float32 rows.
    _, weight = k_weight(40, 512, qtype)
    rows = tied_panel_rows(weight, f"{weight.kind}_panels", tuple(pack_panels(weight)))
    ids = torch.tensor([0, 39, 7, 15, 16, 3, 7])
    assert torch.equal(rows.dequantize(ids), weight.dequantize(ids))


def test_kernels_refuse_what_does_not_match() -> None:
    ops = kernels.load()
    _, weight = k_weight(16, 512, "Q4_K")
    with pytest.raises(RuntimeError, match="multiple of 256"):
        ops.kquant_linear("q4_k", torch.randn(2, 96), weight.kernel_tensors(), 16)
    with pytest.raises(RuntimeError, match="unknown K-quant kind"):
        ops.kquant_linear("q3_k", torch.randn(2, 512), weight.kernel_tensors(), 16)
    with pytest.raises(RuntimeError, match="inner dimension"):
        ops.kquant_linear("q4_k", torch.randn(2, 256), weight.kernel_tensors(), 16)


# ------------------------------------------------------------------------------------------
# A tiny llama GGUF in K-quants: loaded in its kinds, against transformers on the same file
# ------------------------------------------------------------------------------------------

# As Q4_K_M mixes them: a Q6_K v beside Q4_K q and k makes qkv a "stack" of two kinds.
MIXED = {r"^output\.": "Q6_K", r"ffn_down": "Q6_K", r"attn_v": "Q6_K"}


@pytest.fixture(scope="module")
def k_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("kquant")
    folder = build_tiny_model(root / "llama", "llama", **K_QUANT_OVERRIDES["llama"])
    (root / "file").mkdir()
    return write_gguf(folder, root / "file" / "tiny-Q4_K_M.gguf", "Q4_K", types=MIXED)


def test_engine_runs_the_file_in_its_kinds(k_file: Path) -> None:
    llm = LLM(str(k_file), num_kv_blocks=64, quantization="auto")
    model = llm.engine.model
    layer = model.layers[0]
    suffix = "_panels" if kernels.load().wide() else ""
    linears = [layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj, model.lm_head]
    held = [kernel_weight(linear) for linear in linears]
    kinds = [w.kind if w is not None else None for w in held]
    assert kinds[0] == "stack"
    assert held[0] is not None and [p.kind for p in held[0].parts] == kinds[1:2] * 2 + kinds[3:4]
    assert kinds[1] == kinds[2] == "q4_k" + suffix and kinds[3] == kinds[4] == "q6_k" + suffix
    assert isinstance(model.embed_tokens, KQuantWeight)
    assert llm.engine.runner.decode_step is not None  # the C++ step runs the kinds too
    # Resident bytes: every matrix within 5% of its bytes in the file.
    kinds_in_file = (QT.Q4_K, QT.Q6_K)
    tensors = gguf.GGUFReader(k_file).tensors
    file_bytes = sum(int(t.n_bytes) for t in tensors if t.tensor_type in kinds_in_file)
    products = [model.lm_head] + [
        getattr(lay, name)
        for lay in model.layers
        for name in ("o_proj", "gate_up_proj", "down_proj")
    ]
    products += [part for lay in model.layers for part in held_parts(lay.qkv_proj)]
    resident = model.embed_tokens.nbytes + sum(held_bytes(linear) for linear in products)
    assert file_bytes < resident <= 1.05 * file_bytes
    # Logits within tolerance of transformers on the same file (dequantized), prompt and decode.
    hf = load_hf_gguf(k_file)
    rng = np.random.default_rng(0)
    prompts = [[BOS_ID, *rng.integers(4, 512, size=n).tolist()] for n in (3, 17, 40)]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=5, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            want = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
        for step, got in enumerate(out.logprobs):
            row = want[len(prompt) - 1 + step]
            assert int(row.argmax()) == out.token_ids[step], (prompt, step)
            assert max(abs(lp - float(row[t])) for t, lp in got.items()) < 5e-3, (prompt, step)


def test_tokens_do_not_depend_on_batch_chunks_or_cache(k_file: Path) -> None:
    # The same prompts alone, together, chunked into 16-token steps and from the prefix cache:
    # the same tokens and the same logprobs to the bit (decode rows in the C++ step, prompt
    # rows in the Python pass, both from the K-quant panels).
    rng = np.random.default_rng(3)
    shared = rng.integers(4, 512, size=40).tolist()
    batch = [[BOS_ID, *shared[: n % 2 * 40], *rng.integers(4, 512, size=n).tolist()]
             for n in (3, 9, 20, 31, 44)]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)

    def run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list]]:
        return [(out.token_ids, out.logprobs) for out in llm.generate(prompts, params)]

    plain = LLM(str(k_file), num_kv_blocks=128, enable_prefix_caching=False)
    alone = [run(plain, [prompt])[0] for prompt in batch]
    assert run(plain, batch) == alone
    chunked = LLM(str(k_file), num_kv_blocks=128, max_num_batched_tokens=16)
    assert run(chunked, batch) == alone
    assert run(chunked, batch) == alone  # now with the shared prefixes cached


def test_tied_embedding_is_read_from_the_output_panels(tmp_path: Path) -> None:
    overrides = {**K_QUANT_OVERRIDES["llama"], "tie_word_embeddings": True}
    folder = build_tiny_model(tmp_path / "llama", "llama", **overrides)
    (tmp_path / "file").mkdir()
    path = write_gguf(folder, tmp_path / "file" / "tiny-tied-Q4_K.gguf", "Q4_K")
    llm = LLM(str(path), num_kv_blocks=64)
    model = llm.engine.model
    if kernels.load().wide():  # held once, as the output layer's panels
        assert isinstance(model.embed_tokens, KPanelRows)
    hf = load_hf_gguf(path)
    prompt = [BOS_ID, *np.random.default_rng(5).integers(4, 512, size=12).tolist()]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=5, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([prompt + out.token_ids])).logits[0], dim=-1)
    for step, got in enumerate(out.logprobs):
        row = want[len(prompt) - 1 + step]
        assert max(abs(lp - float(row[t])) for t, lp in got.items()) < 5e-3, step


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1"])
def test_q5_files_run_in_their_kinds(tmp_path: Path, qtype: str) -> None:
    # Rows of 64: a Q4_K_M file of a small model holds such matrices in Q5_0 (and Q5_1).
    folder = build_tiny_model(tmp_path / "llama", "llama")
    (tmp_path / "file").mkdir()
    path = write_gguf(folder, tmp_path / "file" / f"tiny-{qtype}.gguf", qtype)
    llm = LLM(str(path), num_kv_blocks=64)
    held = kernel_weight(llm.engine.model.layers[0].o_proj)
    assert held is not None and held.kind.startswith(qtype.lower())
    hf = load_hf_gguf(path)
    prompt = [BOS_ID, *np.random.default_rng(6).integers(4, 512, size=12).tolist()]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=5, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([prompt + out.token_ids])).logits[0], dim=-1)
    for step, got in enumerate(out.logprobs):
        row = want[len(prompt) - 1 + step]
        assert max(abs(lp - float(row[t])) for t, lp in got.items()) < 5e-3, step
