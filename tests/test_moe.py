"""Mixture of experts (Qwen3-MoE): the block against transformers' own, the model from a
Hugging Face folder and from GGUF files (F32; experts kept in Q8_0, Q4_1, Q4_K, Q6_K) against
transformers, and a token's logits independent of the tokens that share its experts."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from tests.fixtures.engine_runs import staggered
from tests.fixtures.tiny_gguf import gguf_contents, write_contents, write_gguf
from tests.fixtures.tiny_models import (
    BOS_ID,
    VOCAB_SIZE,
    build_tiny_model,
    hf_greedy,
    load_hf_model,
)
from zerohop import LLM, SamplingParams
from zerohop.engine import kernels
from zerohop.engine.base.errors import ModelLoadError
from zerohop.engine.model.linear import (
    kernel_weight,
    make_dense_linear,
    make_plain_linear,
    make_quantized_linear,
)
from zerohop.engine.model.moe import Expert, MoeBlock
from zerohop.engine.model.quant import quantize_q8_0

MAX_NEW = 8
ENGINE = dict(num_kv_blocks=256, max_num_seqs=32)


def greedy(max_tokens: int = MAX_NEW, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          logprobs=logprobs)  # fmt: skip


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(4, VOCAB_SIZE) for _ in range(40)]  # whole blocks to cache
    out = []
    for i in range(count):
        tail = [rng.randrange(4, VOCAB_SIZE) for _ in range(rng.randrange(2, 60))]
        out.append([BOS_ID, *(shared if i % 3 == 0 else []), *tail])
    return out


@pytest.fixture(scope="module")
def mixed_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Layers 0 and 2 sparse, layer 1 dense (mlp_only_layers)."""
    return build_tiny_model(tmp_path_factory.mktemp("moe") / "qwen3moe", "qwen3moe")


@pytest.fixture(scope="module")
def sparse_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every layer sparse, as llama.cpp's qwen3moe files are."""
    folder = tmp_path_factory.mktemp("moe") / "qwen3moe-sparse"
    return build_tiny_model(folder, "qwen3moe", mlp_only_layers=[])


@pytest.fixture(scope="module")
def gguf_files(sparse_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe-gguf")
    files = {
        q: write_gguf(sparse_folder, root / f"moe-{q}.gguf", q) for q in ("F32", "Q8_0", "Q4_1")
    }
    # K-quants need rows of 256 (their block): hidden and expert widths 256.
    shape = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, head_dim=64)
    wide = build_tiny_model(root / "wide", "qwen3moe", mlp_only_layers=[], **shape)
    for qtype in ("Q4_K", "Q6_K"):
        files[qtype] = write_gguf(wide, root / f"moe-{qtype}.gguf", qtype)
    return files


# ------------------------------------------------------------------------------------------
# The block
# ------------------------------------------------------------------------------------------


def hf_block(experts: int, top_k: int, norm: bool, seed: int) -> Qwen3MoeSparseMoeBlock:
    config = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=experts,
                            num_experts_per_tok=top_k, norm_topk_prob=norm)  # fmt: skip
    config._experts_implementation = "eager"  # the reference loop, not a grouped product
    torch.manual_seed(seed)
    block = Qwen3MoeSparseMoeBlock(config).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.25)
    return block


def our_block(
    hf: Qwen3MoeSparseMoeBlock, make_linear=make_plain_linear, make_router=make_plain_linear
) -> MoeBlock:
    gate_up, down = hf.experts.gate_up_proj.detach(), hf.experts.down_proj.detach()
    experts = [Expert(make_linear(gate_up[e], None), make_linear(down[e], None))
               for e in range(gate_up.shape[0])]  # fmt: skip
    return MoeBlock(make_router(hf.gate.weight.detach().contiguous(), None), experts,
                    hf.gate.top_k, hf.gate.norm_topk_prob)  # fmt: skip


@pytest.mark.parametrize(("experts", "top_k", "norm"), [(8, 2, True), (16, 4, False), (4, 1, True)])
def test_block_computes_as_transformers(experts: int, top_k: int, norm: bool) -> None:
    hf = hf_block(experts, top_k, norm, seed=experts)
    x = torch.randn(1, 37, 64)
    with torch.inference_mode():
        want = hf(x)[0]
        got = our_block(hf)(x[0])
    # Top-2 sums the same two products as transformers (a + b is b + a); more than two
    # are summed by rank, transformers by expert id.
    torch.testing.assert_close(got, want, rtol=0, atol=0 if top_k <= 2 else 1e-6)


def test_router_picks_as_transformers_ties_included() -> None:
    hf = hf_block(8, 2, True, seed=3)
    with torch.no_grad():
        hf.gate.weight[5] = hf.gate.weight[2]  # experts 2 and 5 score alike
        hf.gate.weight[6] = hf.gate.weight[2] + 0.5  # and 6 is near them
    x = torch.randn(50, 64)
    chosen, weights = our_block(hf).route(x)
    _, hf_weights, hf_chosen = hf.gate(x)
    assert torch.equal(chosen, hf_chosen)
    assert torch.equal(weights, hf_weights)


@pytest.mark.parametrize("kind", ["dense", "q8_0", "q8_0 int8 rows"])
def test_a_tokens_output_does_not_depend_on_the_tokens_beside_it(kind: str) -> None:
    # "int8 rows": the row-major q8_0 product (machines without AVX-512 VNNI) with its opt-in
    # int8 activations for decode rows only, where a row's kind changes its arithmetic: each
    # expert's product must be told which of its rows decode.
    ops = kernels.load()

    def make_linear(weight: torch.Tensor, bias: None) -> object:
        if kind == "dense":
            return make_dense_linear(weight.contiguous(), bias)
        quantized = quantize_q8_0(weight.contiguous())
        if kind == "q8_0":
            return make_quantized_linear(quantized, bias)
        return lambda x: ops.q8_0_linear(x.contiguous(), quantized.qs, quantized.scales)

    hf = hf_block(8, 2, True, seed=1)
    block = our_block(hf, make_linear, make_dense_linear)  # the router as the model has it
    block.activation, block.set_decode_rows = ops.silu_mul, ops.set_decode_rows
    int8 = kind == "q8_0 int8 rows"
    x = torch.randn(45, 64)
    integer_dots = ops.integer_dots()
    ops.set_integer_dots(int8)
    try:
        for decode_rows in (-1, 0, 9):  # all decodes, all prompt rows, 9 decodes first
            ops.set_decode_rows(decode_rows)
            together = block(x, decode_rows)
            for start, end in ((0, 1), (0, 9), (9, 10), (5, 45), (44, 45)):
                rows = -1 if decode_rows < 0 else max(0, min(decode_rows - start, end - start))
                ops.set_decode_rows(rows)
                assert torch.equal(block(x[start:end], rows), together[start:end])
    finally:
        ops.set_decode_rows(-1)
        ops.set_integer_dots(integer_dots)


# ------------------------------------------------------------------------------------------
# Whole models
# ------------------------------------------------------------------------------------------


def test_hf_folder_greedy_matches_transformers(mixed_folder: Path) -> None:
    llm = LLM(str(mixed_folder), **ENGINE)
    layers = llm.engine.model.layers
    assert [layer.moe is not None for layer in layers] == [True, False, True]
    assert len(layers[0].moe.experts) == 8 and layers[0].moe.top_k == 2  # type: ignore[union-attr]
    batch = prompts(3, seed=1)
    for prompt, out in zip(batch, llm.generate(batch, greedy()), strict=True):
        assert out.token_ids == hf_greedy(mixed_folder, prompt, MAX_NEW)


def test_stacked_expert_parameters_load_as_the_per_expert_ones(
    mixed_folder: Path, tmp_path: Path
) -> None:
    # transformers 5 holds each layer's experts as [E, 2I, H] and [E, H, I] parameters; a
    # checkpoint saved from that state dict as is names them so.
    folder = tmp_path / "stacked"
    shutil.copytree(mixed_folder, folder)
    state = {k: v.contiguous() for k, v in load_hf_model(mixed_folder).state_dict().items()}
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    save_file(state, folder / "model.safetensors")
    batch = prompts(2, seed=7)
    outs = LLM(str(folder), **ENGINE).generate(batch, greedy())
    for prompt, out in zip(batch, outs, strict=True):
        assert out.token_ids == hf_greedy(mixed_folder, prompt, MAX_NEW)


def test_f32_gguf_greedy_matches_transformers(gguf_files: dict[str, Path], sparse_folder: Path):
    llm = LLM(str(gguf_files["F32"]), **ENGINE)
    assert all(layer.moe is not None for layer in llm.engine.model.layers)
    batch = prompts(3, seed=2)
    for prompt, out in zip(batch, llm.generate(batch, greedy()), strict=True):
        assert out.token_ids == hf_greedy(sparse_folder, prompt, MAX_NEW)


@pytest.mark.parametrize(
    ("qtype", "layer", "expert", "product", "seed"),
    [
        ("Q8_0", 0, 3, "down_proj", 3),
        ("Q4_1", 0, 3, "down_proj", 3),
        ("Q4_K", 1, 5, "gate_up_proj", 6),
        ("Q6_K", 1, 5, "gate_up_proj", 6),
    ],
)
def test_quantized_experts_are_multiplied_in_the_files_own_kind(
    gguf_files: dict[str, Path], qtype: str, layer: int, expert: int, product: str, seed: int
) -> None:
    """Block (Q8_0, Q4_1) and K-quant (Q4_K, Q6_K) experts stay in their kind, close to the
    dequantized model."""
    quantized = LLM(str(gguf_files[qtype]), **ENGINE)
    exact = LLM(str(gguf_files[qtype]), **ENGINE, quantization="none")
    linear = getattr(quantized.engine.model.layers[layer].moe.experts[expert], product)  # type: ignore[union-attr]
    assert kernel_weight(linear).kind.startswith(qtype.lower())  # type: ignore[union-attr]
    batch = prompts(3, seed=seed)
    one = greedy(1, logprobs=5)
    for got, want in zip(quantized.generate(batch, one), exact.generate(batch, one), strict=True):
        got_lp, want_lp = got.logprobs[0], want.logprobs[0]
        top = max(want_lp, key=want_lp.__getitem__)
        assert top in got_lp and abs(got_lp[top] - want_lp[top]) < 0.05, (got_lp, want_lp)


def flatten(deltas: list) -> tuple[list[int], list]:
    tokens, logprobs = [], []
    for new_ids, new_logprobs in deltas:
        tokens += new_ids
        logprobs += new_logprobs or []
    return tokens, logprobs


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_K"])
def test_alone_batched_chunked_and_cached_give_the_same_logits(
    gguf_files: dict[str, Path], qtype: str
) -> None:
    path, batch, params = str(gguf_files[qtype]), prompts(12, seed=4), greedy(logprobs=5)

    def results(outs) -> list[tuple[list[int], list]]:
        return [(out.token_ids, out.logprobs) for out in outs]

    alone = LLM(path, **ENGINE, enable_prefix_caching=False)
    want = [results(alone.generate([p], params))[0] for p in batch]
    together = LLM(path, **ENGINE)
    assert results(together.generate(batch, params)) == want
    assert results(together.generate(batch, params)) == want  # from the prefix cache
    chunked = LLM(path, **ENGINE, max_num_batched_tokens=24)
    assert [flatten(d) for d in staggered(chunked, batch, params)] == want


# ------------------------------------------------------------------------------------------
# Refusals
# ------------------------------------------------------------------------------------------


def test_a_file_without_its_expert_count_is_refused(sparse_folder: Path, tmp_path: Path) -> None:
    contents = gguf_contents(sparse_folder, "F32")
    del contents.kv["qwen3moe.expert_count"]
    path = write_contents(contents, tmp_path / "no-count.gguf")
    with pytest.raises(ModelLoadError, match=r"no-count\.gguf.*'qwen3moe\.expert_count'"):
        LLM(str(path), **ENGINE)


def test_a_missing_expert_is_named_in_the_files_terms(sparse_folder: Path, tmp_path: Path) -> None:
    contents = gguf_contents(sparse_folder, "F32")
    data, qtype = contents.tensors["blk.1.ffn_up_exps.weight"]
    contents.tensors["blk.1.ffn_up_exps.weight"] = (data[:7].copy(), qtype)  # 7 of 8 experts
    path = write_contents(contents, tmp_path / "seven.gguf")
    with pytest.raises(ModelLoadError, match=r"'blk\.1\.ffn_up_exps\.weight \(expert 7\)'"):
        LLM(str(path), **ENGINE)


# ------------------------------------------------------------------------------------------
# OLMoE: 4 of 8 experts unnormalized, q/k norms over all heads' projection
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def olmoe_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("moe") / "olmoe", "olmoe")


@pytest.mark.parametrize("source", ["folder", "F32 GGUF"])
def test_olmoe_greedy_matches_transformers(olmoe_folder: Path, tmp_path: Path, source: str) -> None:
    path = olmoe_folder
    if source == "F32 GGUF":
        path = write_gguf(olmoe_folder, tmp_path / "olmoe-F32.gguf", "F32")
    llm = LLM(str(path), **ENGINE)
    model = llm.engine.model
    assert model.config.qk_norm_whole and model.layers[0].q_norm.shape == (64,)  # type: ignore[union-attr]
    moe = model.layers[1].moe
    assert moe is not None and moe.top_k == 4 and not moe.norm_topk_prob
    batch = prompts(3, seed=5)
    for prompt, out in zip(batch, llm.generate(batch, greedy()), strict=True):
        assert out.token_ids == hf_greedy(olmoe_folder, prompt, MAX_NEW)


def test_olmoe_clip_qkv_is_refused(tmp_path: Path) -> None:
    folder = build_tiny_model(tmp_path / "clipped", "olmoe", clip_qkv=8.0)
    with pytest.raises(ModelLoadError, match=r"config\.json: field 'clip_qkv' = 8\.0"):
        LLM(str(folder), **ENGINE)
