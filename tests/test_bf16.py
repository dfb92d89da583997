"""bfloat16 weights: multiplied with AVX-512 BF16 (kernels/bf16_gemm.h: vdpbf16ps, the
activations rounded to bfloat16) where the kernels have it, else (or with ZEROHOP_BF16_DOT=0)
on the dense kernel's exact widening path; either way held at 16 bits, embedding and output
layer included.

A bfloat16 folder on the widening path gives transformers' greedy ids (transformers runs the
same bfloat16 weights in float32: both exact products, the same sums up to float32 order). On
the bf16 dot the activations lose bits, so its logits are compared within a tolerance instead
(teacher-forced on the engine's own ids), as quantized kinds are.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import BOS_ID, build_tiny_model, hf_greedy, load_hf_model
from zerohop import LLM, SamplingParams
from zerohop.engine import kernels
from zerohop.engine.model.linear import DensePanelRows, kernel_weight, make_dense_path_linear

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the CPU kernels are not built")


def dot_paths() -> list[bool]:
    """The bf16 dot where the kernels have it, and always the widening path (forced)."""
    return [True, False] if kernels.load().bf16_dot() else [False]


def rounded_reference(x: torch.Tensor, w: torch.Tensor, bf16_dot: bool) -> torch.Tensor:
    x = x.bfloat16() if bf16_dot else x
    return (x.double() @ w.double().T).float()


@pytest.mark.parametrize("bf16_dot", dot_paths())
@pytest.mark.parametrize(("n", "k"), [(37, 64), (96, 130), (16, 8)])
def test_products_match_the_float_reference(bf16_dot: bool, n: int, k: int) -> None:
    torch.manual_seed(n + k)
    w = torch.randn(n, k).bfloat16()
    bias = torch.randn(n)
    x = torch.randn(9, k)
    linear = make_dense_path_linear(w, bias, bf16_dot)
    held = kernel_weight(linear)
    assert held is not None and held.kind == ("bf16_panels" if bf16_dot else "dense")
    assert held.tensors[0].dtype == torch.bfloat16
    got = linear(x) - bias
    # Against x as the product takes it (bfloat16-rounded on the dot): float32 sums only.
    scale = (x.abs().double() @ w.abs().double().T).float()
    assert ((got - rounded_reference(x, w, bf16_dot)).abs() <= 1e-5 * scale + 1e-6).all()
    # Against x unrounded: within bfloat16's rounding of the activations (2^-9 relative).
    assert ((got - rounded_reference(x, w, False)).abs() <= 2**-8 * scale + 1e-5).all()


@pytest.mark.parametrize("bf16_dot", dot_paths())
def test_rows_are_batch_invariant(bf16_dot: bool) -> None:
    torch.manual_seed(1)
    w = torch.randn(100, 192).bfloat16()
    linear = make_dense_path_linear(w, None, bf16_dot)
    x = torch.randn(17, 192)
    alone = [linear(x[i : i + 1]) for i in range(17)]
    for rows in (1, 3, 8, 17):
        together = linear(x[:rows])
        for i in range(rows):
            assert torch.equal(together[i : i + 1], alone[i]), (bf16_dot, rows, i)


def test_kernel_timing_is_printed() -> None:
    """Not asserted: the two paths' times at 1, 8 and 64 rows (benchmarks/bf16_products.py
    measures them properly)."""
    if not kernels.load().bf16_dot():
        pytest.skip("no AVX-512 BF16 here")
    w = torch.randn(1536, 576).bfloat16()
    paths = {dot: make_dense_path_linear(w, None, dot) for dot in (False, True)}
    for rows in (1, 8, 64):
        x = torch.randn(rows, 576)
        times = {}
        for dot, linear in paths.items():
            linear(x)
            start = time.perf_counter()
            for _ in range(20):
                linear(x)
            times[dot] = (time.perf_counter() - start) / 20 * 1e3
        print(f"rows {rows}: widen {times[False]:.3f} ms, bf16 dot {times[True]:.3f} ms")


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny tied llama saved by transformers with torch_dtype bfloat16."""
    root = tmp_path_factory.mktemp("bf16")
    f32 = build_tiny_model(root / "f32", "llama", tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(f32, dtype=torch.bfloat16)
    folder = root / "bf16"
    model.save_pretrained(folder, safe_serialization=True)
    for name in f32.iterdir():
        if name.name.startswith(("tokenizer", "special_tokens", "generation")):
            shutil.copy(name, folder / name.name)
    return folder


def matrix_bytes(model) -> tuple[int, int]:
    """Bytes held for every matrix (the kernels' panels, and an embedding not read from
    them), and the bytes the same matrices take in float32."""
    linears = [model.lm_head]
    for layer in model.layers:
        linears += [layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj]
    resident = f32_bytes = 0
    for linear in linears:
        weight = kernel_weight(linear)
        assert weight is not None
        (panels,) = weight.tensors
        resident += panels.nbytes
        f32_bytes += 4 * weight.out_features * panels[0].numel() // 16
    embed = model.embed_tokens
    if not isinstance(embed, DensePanelRows):  # else held once, as lm_head's panels
        resident += embed.nbytes
        f32_bytes += 4 * embed.nelement()
    return resident, f32_bytes


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [[BOS_ID, *rng.integers(4, 500, size=n).tolist()] for n in (3, 17, 33)]


def test_bf16_folder_on_the_widening_path_matches_transformers(
    bf16_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZEROHOP_BF16_DOT", "0")
    llm = LLM(str(bf16_folder), num_kv_blocks=64)
    model = llm.engine.model
    assert kernel_weight(model.layers[0].o_proj).kind == "dense"  # type: ignore[union-attr]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for prompt, out in zip(prompts(), llm.generate(prompts(), params), strict=True):
        assert out.token_ids == hf_greedy(bf16_folder, prompt, 8)


def test_bf16_folder_is_held_at_half_of_float32(bf16_folder: Path) -> None:
    llm = LLM(str(bf16_folder), num_kv_blocks=64)
    model = llm.engine.model
    kind = "bf16_panels" if kernels.load().bf16_dot() else "dense"
    assert kernel_weight(model.lm_head).kind == kind  # type: ignore[union-attr]
    assert isinstance(model.embed_tokens, DensePanelRows)  # tied: read from lm_head's panels
    assert model.embed_tokens.panels.dtype == torch.bfloat16
    assert llm.engine.runner.decode_step is not None  # the C++ step runs the bf16 panels too
    resident, f32_bytes = matrix_bytes(model)
    assert f32_bytes / 2 <= resident <= 1.01 * f32_bytes / 2  # + the panels' padding rows
    # Logits against transformers in float32 on the same bfloat16 weights with every linear
    # layer's input rounded to bfloat16 (nearest even) as the dot rounds it: equal up to
    # float32 summation order. Without the rounding they differ by up to ~0.1 here.
    hf = bf16_rounding_transformers(bf16_folder) if kind == "bf16_panels" else None
    hf = hf or load_hf_model(bf16_folder)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=5, ignore_eos=True)
    for prompt, out in zip(prompts(), llm.generate(prompts(), params), strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out.token_ids])).logits[0].float()
        want = torch.log_softmax(logits, dim=-1)
        for step, got in enumerate(out.logprobs):
            row = want[len(prompt) - 1 + step]
            assert int(row.argmax()) == out.token_ids[step], (prompt, step)
            assert max(abs(lp - float(row[t])) for t, lp in got.items()) < 2e-3, (prompt, step)


def bf16_rounding_transformers(folder: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda _, args: (args[0].bfloat16().float(),))
    return model


def test_bf16_gguf_tokens_do_not_depend_on_batch_chunks_or_cache(
    bf16_folder: Path, tmp_path: Path
) -> None:
    path = write_gguf(bf16_folder.parent / "f32", tmp_path / "tiny-BF16.gguf", "BF16")
    rng = np.random.default_rng(3)
    shared = rng.integers(4, 500, size=40).tolist()
    batch = [[BOS_ID, *shared[: n % 2 * 40], *rng.integers(4, 500, size=n).tolist()]
             for n in (3, 9, 20, 31)]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)

    def run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list]]:
        return [(out.token_ids, out.logprobs) for out in llm.generate(prompts, params)]

    plain = LLM(str(path), num_kv_blocks=128, enable_prefix_caching=False)
    model = plain.engine.model
    kind = "bf16_panels" if kernels.load().bf16_dot() else "dense"
    assert kernel_weight(model.layers[0].gate_up_proj).kind == kind  # type: ignore[union-attr]
    resident, f32_bytes = matrix_bytes(model)
    assert f32_bytes / 2 <= resident <= 1.01 * f32_bytes / 2  # + the panels' padding rows
    alone = [run(plain, [prompt])[0] for prompt in batch]
    assert run(plain, batch) == alone
    chunked = LLM(str(path), num_kv_blocks=128, max_num_batched_tokens=16)
    assert run(chunked, batch) == alone
    assert run(chunked, batch) == alone  # now with the shared prefixes cached
