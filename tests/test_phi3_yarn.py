"""Phi-3 / Phi-4-mini (fused qkv_proj and gate_up_proj, RoPE on part of each head) and YaRN RoPE
scaling, against transformers on the same random weights.

The cos/sin tables must equal transformers' bit for bit (YaRN's ramp, its attention factor,
a partial rotary), and greedy ids must be identical at float32: on the C++ kernels (with the
decode step as one C++ call) and on plain torch ops, from the Hugging Face folder and from a
GGUF file written as llama.cpp's converter writes it. YaRN prompts run past the original
context, where its interpolation acts. Rope types zerohop lacks stay refused, by field.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from gguf import GGUFValueType as VT
from transformers import Qwen2Config
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from tests.fixtures.tiny_gguf import (
    gguf_contents,
    hf_gguf_greedy,
    quantize,
    write_contents,
    write_gguf,
)
from tests.fixtures.tiny_models import (
    ARCHS,
    BOS_ID,
    VOCAB_SIZE,
    YARN_ROPE,
    build_tiny_model,
    hf_greedy,
)
from zerohop import LLM, SamplingParams
from zerohop.engine import kernels
from zerohop.engine.base.errors import ModelLoadError
from zerohop.engine.model.config import ModelConfig
from zerohop.engine.model.fused_weights import split_fused
from zerohop.engine.model.kquant import from_gguf_kquant
from zerohop.engine.model.quant import quantize_q8_0
from zerohop.engine.model.rope import RotaryEmbedding

MAX_NEW = 8
ORIGINAL = YARN_ROPE["original_max_position_embeddings"]
# Phi-4-mini's kind of RoPE scaling, for 6 rotated pairs (3/4 of a 16-dim head).
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0, 1.05, 1.1, 1.3, 1.6, 2.0],
    "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.0],
}
Factory = Callable[..., Path]

ARCHS_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 1,
    "intermediate_size": 128,
    "vocab_size": VOCAB_SIZE,
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Factory:
    """`folder("phi3", partial_rotary_factor=1.0)` -> that tiny model, built once."""
    root = tmp_path_factory.mktemp("phi3_yarn")
    built: dict[str, Path] = {}

    def get(arch: str, **overrides: Any) -> Path:
        key = f"{arch}-{abs(hash(repr(sorted(overrides.items()))))}"
        if key not in built:
            built[key] = build_tiny_model(root / key, arch, **overrides)
        return built[key]

    return get


def prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[BOS_ID] + [rng.randrange(4, VOCAB_SIZE) for _ in range(n - 1)] for n in lengths]


def assert_greedy_matches(
    path: Path, reference: Path, lengths: tuple[int, ...], **options: Any
) -> LLM:
    options = {"num_kv_blocks": 64, "max_num_batched_tokens": 256, **options}
    llm = LLM(str(path), quantization="none", **options)
    batch = prompts(len(lengths), lengths)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    for prompt, out in zip(batch, llm.generate(batch, params), strict=True):
        assert out.token_ids == hf_greedy(reference, prompt, MAX_NEW), f"{len(prompt)} tokens"
    return llm


# ------------------------------------------------------------------------------------------
# The cos/sin tables
# ------------------------------------------------------------------------------------------

YARN_VARIANTS = {
    "defaults": {},
    "attention-factor": {"attention_factor": 0.8},
    "betas-untruncated": {"beta_fast": 16, "beta_slow": 2, "truncate": False},
    "mscales": {"mscale": 0.7, "mscale_all_dim": 0.5},
}


@pytest.mark.parametrize("variant", list(YARN_VARIANTS))
def test_yarn_tables_equal_transformers(variant: str) -> None:
    rope = {**YARN_ROPE, **YARN_VARIANTS[variant]}
    config = Qwen2Config(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=128, rope_parameters=rope
    )
    ours = ModelConfig.from_dict(
        {**config.to_dict(), "architectures": ["Qwen2ForCausalLM"]}, source="test"
    )
    assert_tables_equal(Qwen2RotaryEmbedding(config), ours, 16)


@pytest.mark.parametrize("partial", [0.75, 0.5])
def test_partial_rotary_tables_equal_transformers(partial: float) -> None:
    config_cls, _, overrides = ARCHS["phi3"]
    overrides = {**copy.deepcopy(overrides), "partial_rotary_factor": partial}
    config = config_cls(hidden_size=64, num_attention_heads=4, **overrides)
    ours = ModelConfig.from_dict({**config.to_dict(), "architectures": ["Phi3ForCausalLM"]})
    assert ours.rope.rotary_dim == int(16 * partial)
    assert_tables_equal(Phi3RotaryEmbedding(config), ours, int(16 * partial))


@pytest.mark.parametrize("context", [4 * ORIGINAL, ORIGINAL], ids=["long", "short"])
def test_longrope_tables_equal_transformers(context: int) -> None:
    """Long factors where the model's context passes the original one, as transformers takes
    them for a sequence that long; short ones within it."""
    config_cls, _, overrides = ARCHS["phi3"]
    overrides = {**copy.deepcopy(overrides), "rope_parameters": copy.deepcopy(LONGROPE)}
    config = config_cls(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=context,
        original_max_position_embeddings=ORIGINAL,
        **overrides,
    )
    ours = ModelConfig.from_dict({**config.to_dict(), "architectures": ["Phi3ForCausalLM"]})
    assert ours.rope.type == "longrope" and (ours.rope.attention_factor > 1) == (context > ORIGINAL)
    assert_tables_equal(Phi3RotaryEmbedding(config), ours, 12, context)


def assert_tables_equal(
    reference: torch.nn.Module, ours: ModelConfig, width: int, count: int = 128
) -> None:
    positions = torch.arange(count)
    with torch.no_grad():
        cos, sin = reference(torch.zeros(1, dtype=torch.float32), positions[None])
    table = RotaryEmbedding(ours.head_dim, count, ours.rope, torch.float32, "cpu")
    assert table.cos.shape == (count, width) == cos[0].shape
    torch.testing.assert_close(table.cos, cos[0], rtol=0, atol=0)
    torch.testing.assert_close(table.sin, sin[0], rtol=0, atol=0)


# ------------------------------------------------------------------------------------------
# Greedy ids: Phi-3 and YaRN models, folder and GGUF file, kernels and plain torch
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("partial", [0.75, 1.0])
@pytest.mark.parametrize("with_kernels", [True, False], ids=["kernels", "torch"])
def test_phi3_greedy_matches_transformers(
    folder: Factory, partial: float, with_kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not with_kernels:
        monkeypatch.setattr(kernels, "available", lambda: False)
    path = folder("phi3", partial_rotary_factor=partial)
    llm = assert_greedy_matches(path, path, (5, 23))
    assert llm.engine.model.config.rope.rotary_dim == (12 if partial < 1 else None)
    # With the kernels, decode steps run as one C++ call, partial rotary included.
    assert (llm.engine.runner.decode_step is not None) == (with_kernels and kernels.available())


@pytest.mark.parametrize("with_kernels", [True, False], ids=["kernels", "torch"])
def test_yarn_greedy_matches_transformers_past_the_original_context(
    folder: Factory, with_kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not with_kernels:
        monkeypatch.setattr(kernels, "available", lambda: False)
    path = folder("qwen2-yarn")
    assert_greedy_matches(path, path, (5, ORIGINAL + 9))  # to position 48 of 32 original


@pytest.mark.parametrize(
    ("context", "lengths"),
    [(4 * ORIGINAL, (ORIGINAL + 9,)), (ORIGINAL, (5, 17))],
    ids=["long", "short"],
)
def test_longrope_greedy_matches_transformers(
    folder: Factory, tmp_path: Path, context: int, lengths: tuple[int, ...]
) -> None:
    """Phi-4-mini's LongRoPE, from the folder and from the GGUF file (factors as tensors)."""
    path = longrope_phi3(folder, context)
    assert_greedy_matches(path, path, lengths)
    if context > ORIGINAL:  # served within the original context: the short factors
        llm = assert_greedy_matches(path, path, (5, 17), max_model_len=ORIGINAL)
        assert llm.engine.max_model_len == ORIGINAL
    written = write_gguf(path, tmp_path / "longrope.gguf", "F32")
    names = {t.name for t in gguf.GGUFReader(written).tensors}
    assert {"rope_factors_long.weight", "rope_factors_short.weight"} <= names
    assert_greedy_matches(written, path, lengths)


def longrope_phi3(folder: Factory, context: int) -> Path:
    return folder(
        "phi3",
        max_position_embeddings=context,
        original_max_position_embeddings=ORIGINAL,
        rope_parameters=copy.deepcopy(LONGROPE),
    )


def test_yarn_changes_the_model(folder: Factory) -> None:
    """The scaling is not a no-op at these lengths: unscaled RoPE generates other ids."""
    plain = folder("qwen2", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    (prompt,) = prompts(7, (ORIGINAL + 9,))
    assert hf_greedy(plain, prompt, MAX_NEW) != hf_greedy(folder("qwen2-yarn"), prompt, MAX_NEW)


@pytest.mark.parametrize("partial", [0.75, 1.0])
def test_phi3_gguf_matches_the_folder(folder: Factory, tmp_path: Path, partial: float) -> None:
    """llama.cpp's phi3 layout: attn_qkv and ffn_up (gate then up) fused, and
    `phi3.rope.dimension_count` the rotated dims."""
    path = folder("phi3", partial_rotary_factor=partial)
    written = write_gguf(path, tmp_path / "phi3.gguf", "F32")
    reader = gguf.GGUFReader(written)
    shapes = {t.name: tuple(reversed(t.shape.tolist())) for t in reader.tensors}
    assert shapes["blk.0.attn_qkv.weight"] == (64 + 2 * 2 * 16, 64)
    assert shapes["blk.0.ffn_up.weight"] == (2 * 128, 64) and "blk.0.ffn_gate.weight" not in shapes
    assert reader.fields["phi3.rope.dimension_count"].contents() == int(16 * partial)
    assert_greedy_matches(written, path, (5, 23))


def test_phi3_q8_0_file_matches_transformers_on_the_file(folder: Factory, tmp_path: Path) -> None:
    """transformers' own reading of a Q8_0 phi3 file (its fused tensors split its way) gives
    the same ids. Whole-head rotary: transformers reads no `phi3.rope.dimension_count`."""
    written = write_gguf(folder("phi3", partial_rotary_factor=1.0), tmp_path / "q8.gguf", "Q8_0")
    llm = LLM(str(written), num_kv_blocks=64, max_num_batched_tokens=256, quantization="none")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    for prompt in prompts(11, (5, 23)):
        (out,) = llm.generate([prompt], params)
        assert out.token_ids == hf_gguf_greedy(written, prompt, MAX_NEW), f"{len(prompt)} tokens"


def test_yarn_gguf_matches_the_folder(folder: Factory, tmp_path: Path) -> None:
    path = folder("qwen2-yarn")
    written = write_gguf(path, tmp_path / "yarn.gguf", "F32")
    reader = gguf.GGUFReader(written)
    assert reader.fields["qwen2.rope.scaling.type"].contents() == "yarn"
    assert reader.fields["qwen2.rope.scaling.original_context_length"].contents() == ORIGINAL
    assert_greedy_matches(written, path, (ORIGINAL + 9,))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K"])
def test_fused_quantized_rows_split_exactly(kind: str) -> None:
    """A block-quantized fused matrix splits into its row ranges, blocks untouched."""
    config = ModelConfig.from_dict(
        {**ARCHS_CONFIG, "hidden_size": 256, "architectures": ["Phi3ForCausalLM"]}
    )
    q_dim, kv_dim = 256, 128  # 4 heads of 64, 2 KV heads
    weight = torch.randn(q_dim + 2 * kv_dim, 256)
    if kind == "Q8_0":
        fused = quantize_q8_0(weight)
    else:
        raw = quantize(weight.numpy(), gguf.GGMLQuantizationType.Q4_K)
        fused = from_gguf_kquant(raw, kind, tuple(weight.shape))
    parts = split_fused({"model.layers.0.self_attn.qkv_proj.weight": fused}, config)
    whole = fused.dequantize()
    bounds = {"q_proj": (0, q_dim), "k_proj": (q_dim, kv_dim), "v_proj": (q_dim + kv_dim, kv_dim)}
    for name, (start, rows) in bounds.items():
        part = parts[f"model.layers.0.self_attn.{name}.weight"]
        assert type(part) is type(fused) and part.shape == (rows, 256)
        assert torch.equal(part.dequantize(), whole[start : start + rows])


# ------------------------------------------------------------------------------------------
# Refusals
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "rope", "needle"),
    [
        ("llama", {"rope_type": "dynamic", "factor": 2.0}, "dynamic"),
        ("phi3", {**LONGROPE, "short_factor": [1.0] * 5}, "'short_factor' must list 6 numbers"),
    ],
    ids=["llama-dynamic", "phi3-longrope-short-factors"],
)
def test_unsupported_rope_types_are_refused(
    folder: Factory, tmp_path: Path, arch: str, rope: dict, needle: str
) -> None:
    source = folder(arch)
    config = json.loads((source / "config.json").read_text())
    field = "rope_parameters"
    config[field] = {**config[field], **rope}
    model = tmp_path / arch
    model.mkdir()
    for item in source.iterdir():
        (model / item.name).symlink_to(item)
    (model / "config.json").unlink()
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as info:
        LLM(str(model), num_kv_blocks=16)
    message = str(info.value)
    assert "config.json" in message and field in message and needle in message


def test_partial_rotary_outside_phi3_is_refused() -> None:
    """transformers' Qwen2 would rotate whole heads whatever the field says."""
    config = {**Qwen2Config(**ARCHS_CONFIG).to_dict(), "architectures": ["Qwen2ForCausalLM"]}
    with pytest.raises(ModelLoadError, match="partial_rotary_factor"):
        ModelConfig.from_dict({**config, "partial_rotary_factor": 0.5}, source="config.json")


def test_gguf_longrope_without_its_factors_is_refused(folder: Factory, tmp_path: Path) -> None:
    contents = gguf_contents(folder("phi3", partial_rotary_factor=1.0), "F32")
    contents.put("phi3.rope.scaling.type", "longrope", VT.STRING)
    path = write_contents(contents, tmp_path / "longrope.gguf")
    with pytest.raises(ModelLoadError) as info:
        LLM(str(path), num_kv_blocks=16)
    message = str(info.value)
    assert path.name in message and "phi3.rope.scaling.type" in message and "longrope" in message


def test_gguf_sliding_window_below_the_context_is_refused(folder: Factory, tmp_path: Path) -> None:
    """Phi-3-mini-4k's files say `phi3.attention.sliding_window` = 2047 of 4096: every layer
    here attends to the whole context, so such a file is refused as its config.json is."""
    contents = gguf_contents(folder("phi3"), "F32")
    contents.put("phi3.attention.sliding_window", 16, VT.UINT32)
    path = write_contents(contents, tmp_path / "window.gguf")
    with pytest.raises(ModelLoadError) as info:
        LLM(str(path), num_kv_blocks=16)
    message = str(info.value)
    assert path.name in message and "phi3.attention.sliding_window" in message
    contents.put("phi3.attention.sliding_window", 2048, VT.UINT32)  # the whole context: loads
    whole = write_contents(contents, tmp_path / "whole-window.gguf")
    assert LLM(str(whole), num_kv_blocks=16).engine.model_config.architecture == "Phi3ForCausalLM"
