"""GGUF files (llama.cpp's format): metadata, model config and dequantized weights.

Read with the `gguf` package, llama.cpp's own reader, mapped copy-on-write. Q8_0, Q4_0 and
Q4_1 matrices can stay in their blocks (`zerohop.engine.model.quant`), Q4_K, Q5_K, Q6_K, Q5_0
and Q5_1 in theirs (`zerohop.engine.model.kquant`) and F16/BF16 matrices at 16 bits; others
are dequantized on load (`gguf.quants.dequantize`) to float32 and then to the engine's dtype.
Tensor names become the Hugging Face names the model code uses, and the converter's Q/K row
permutation of `llama`-architecture files is undone as transformers does.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from zerohop.engine.base.errors import ModelLoadError
from zerohop.engine.model import gemma3
from zerohop.engine.model.config import (
    ExpertConfig,
    ModelConfig,
    RopeConfig,
    yarn_attention_factor,
)
from zerohop.engine.model.kquant import GGUF_K_KINDS, from_gguf_kquant
from zerohop.engine.model.quant import GGUF_KINDS, QuantizedWeight, from_gguf_blocks, quantize_q8_0

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gemma3": gemma3.ARCHITECTURE,
}
SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip

FLOAT_TYPES = ("F32", "F16", "BF16")
SIXTEEN_BIT = {"F16": torch.float16, "BF16": torch.bfloat16}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # phi3: q, k and v fused
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # the mixture-of-experts router
    "post_attention_norm": "post_attention_layernorm",  # gemma3: the attention's output
    "post_ffw_norm": "post_feedforward_layernorm",  # gemma3: the MLP's output
}
# [experts, rows, cols] tensors, one matrix per expert: model.layers.N.mlp.experts.E.<part>
_EXPERT_TENSORS = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
_EXPERT_NAME = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight")
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
WeightT = TypeVar("WeightT", torch.Tensor, QuantizedWeight)
ROPE_FREQS = "rope_freqs.weight"  # llama3-style per-frequency divisors, precomputed
LONGROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")  # phi3's LongRoPE


class GGUFFile:
    """One opened GGUF file: `metadata`, `config()`, `tensors()`."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"{self.path}: file not found")
        try:
            self._reader = _reader_class()(self.path, "c")  # copy-on-write: writable, no copy
        except Exception as exc:  # the reader raises whatever numpy hits in a bad file
            raise ModelLoadError(f"{self.path}: not a readable GGUF file ({exc})") from exc
        self.metadata = {name: _field_value(field) for name, field in self._reader.fields.items()}
        self.architecture = self.require("general.architecture")
        if self.architecture not in ARCHITECTURES:
            raise ModelLoadError(
                f"{self.path}: field 'general.architecture' is {self.architecture!r};"
                f" supported: {', '.join(ARCHITECTURES)}"
            )
        self._tensors = {t.name: t for t in self._reader.tensors}

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise ModelLoadError(f"{self.path}: required field '{key}' is missing")
        return self.metadata[key]

    def arch_int(self, key: str, default: int | None = None) -> int:
        full = f"{self.architecture}.{key}"
        value = self.metadata.get(full, default)
        if value is None:
            raise ModelLoadError(f"{self.path}: required field '{full}' is missing")
        if not isinstance(value, int) or value <= 0:
            raise ModelLoadError(f"{self.path}: field '{full}' must be a positive integer")
        return value

    # -- the model config -----------------------------------------------------------------

    def config(self) -> ModelConfig:
        arch = self.architecture
        hidden = self.arch_int("embedding_length")
        heads = self.arch_int("attention.head_count")
        head_dim = self.arch_int("attention.key_length", hidden // heads)
        embed = self._tensor("token_embd.weight")
        layers = self.arch_int("block_count")
        gemma = None
        if arch == "gemma3":
            where = str(self.path)
            gemma = gemma3.from_gguf(self.get, layers, hidden, heads, head_dim, where)
        else:
            self._refuse_sliding_window()
        return ModelConfig(
            architecture=ARCHITECTURES[arch],
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=self.arch_int("attention.head_count_kv", heads),
            head_dim=head_dim,
            intermediate_size=self.arch_int(
                "feed_forward_length", self.get(f"{arch}.expert_feed_forward_length")
            ),
            vocab_size=int(embed.shape[1]),
            max_position_embeddings=self.arch_int("context_length", 2048),
            rms_norm_eps=float(self.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope=self._rope(head_dim),
            tie_word_embeddings="output.weight" not in self._tensors,
            attention_bias="blk.0.attn_q.bias" in self._tensors,
            qk_norm="blk.0.attn_q_norm.weight" in self._tensors,
            eos_token_ids=self.eos_token_ids(),
            torch_dtype=None,
            experts=self._experts(),
            qk_norm_whole=self._qk_norm_whole(head_dim),
            gemma3=gemma,
        )

    def _qk_norm_whole(self, head_dim: int) -> bool:
        """Whether the q norm spans all heads (OLMoE's) rather than one head (Qwen3's)."""
        norm = self._tensors.get("blk.0.attn_q_norm.weight")
        return norm is not None and int(norm.shape[0]) != head_dim

    def _experts(self) -> ExpertConfig | None:
        arch = self.architecture
        if arch not in ("qwen3moe", "olmoe"):
            return None
        # llama.cpp renormalizes the chosen experts' weights for qwen3moe, not for olmoe,
        # unless the file says; olmoe's experts are feed_forward_length wide; a layer without
        # a router keeps a dense MLP.
        layers = range(self.arch_int("block_count"))
        width = self.get(f"{arch}.feed_forward_length") if arch == "olmoe" else None
        return ExpertConfig(
            count=self.arch_int("expert_count"),
            used=self.arch_int("expert_used_count"),
            intermediate_size=self.arch_int("expert_feed_forward_length", width),
            norm_topk_prob=bool(self.get(f"{arch}.expert_weights_norm", arch == "qwen3moe")),
            dense_layers=tuple(
                i for i in layers if f"blk.{i}.ffn_gate_inp.weight" not in self._tensors
            ),
        )

    def _refuse_sliding_window(self) -> None:
        """A window shorter than the context (Phi-3-mini-4k's 2047) is refused, as config.json's
        `sliding_window` is: every layer here attends to the whole context."""
        key = f"{self.architecture}.attention.sliding_window"
        window, context = self.get(key), self.arch_int("context_length", 2048)
        if isinstance(window, int) and 0 < window < context:
            raise ModelLoadError(
                f"{self.path}: field '{key}' = {window} (below the context length {context})"
                " is not supported"
            )

    def _rope(self, head_dim: int) -> RopeConfig:
        arch = self.architecture
        rope = RopeConfig(theta=float(self.get(f"{arch}.rope.freq_base", 10000.0)))
        rotary = self.arch_int("rope.dimension_count", head_dim)
        if rotary != head_dim and arch != "phi3":
            raise ModelLoadError(
                f"{self.path}: field '{arch}.rope.dimension_count' = {rotary} (partial rotary)"
                f" is not supported; head size is {head_dim}"
            )
        rope.rotary_dim = rotary if rotary != head_dim else None
        scaling = self.get(f"{arch}.rope.scaling.type", "none")
        if scaling == "linear":
            rope.type, rope.factor = "linear", float(self.require(f"{arch}.rope.scaling.factor"))
        elif scaling == "yarn":
            self._yarn(rope)
        elif scaling in ("none", "longrope") and LONGROPE_FACTORS[0] in self._tensors:
            self._longrope(rope, head_dim)
        elif scaling != "none":
            raise ModelLoadError(
                f"{self.path}: field '{arch}.rope.scaling.type' = {scaling!r} is not supported;"
                " supported: none, linear, yarn"
            )
        if ROPE_FREQS in self._tensors:
            rope.freq_factors = tuple(self._dequantize(self._tensor(ROPE_FREQS)).tolist())
        return rope

    def _yarn(self, rope: RopeConfig) -> None:
        """YaRN as llama.cpp reads it: cos/sin scaled by 0.1 * ln(factor) + 1 (over its
        `yarn_log_multiplier` twin where that is set), times `rope.scaling.attn_factor`."""
        key = f"{self.architecture}.rope.scaling."
        rope.type, rope.factor = "yarn", float(self.require(key + "factor"))
        rope.original_max_position_embeddings = self.arch_int(
            "rope.scaling.original_context_length", self.arch_int("context_length", 2048)
        )
        log_mul = float(self.get(key + "yarn_log_multiplier", 0.0))
        mscale = yarn_attention_factor(rope.factor, None, 1.0, log_mul or None)
        rope.attention_factor = mscale * float(self.get(key + "attn_factor", 1.0))
        rope.beta_fast = float(self.get(key + "yarn_beta_fast", 32.0))
        rope.beta_slow = float(self.get(key + "yarn_beta_slow", 1.0))

    def _longrope(self, rope: RopeConfig, head_dim: int) -> None:
        """LongRoPE as llama.cpp's converter writes Phi-3's: the factors as tensors, cos/sin
        scaled by `rope.scaling.attn_factor`."""
        rope.type = "longrope"
        rope.original_max_position_embeddings = self.arch_int(
            "rope.scaling.original_context_length", self.arch_int("context_length", 2048)
        )
        key = f"{self.architecture}.rope.scaling.attn_factor"
        rope.attention_factor = float(self.get(key, 1.0))
        count = (rope.rotary_dim or head_dim) // 2
        parts = zip(("short_factor", "long_factor"), LONGROPE_FACTORS, strict=True)
        for name, tensor_name in parts:
            values = self._dequantize(self._tensor(tensor_name)).reshape(-1).tolist()
            if len(values) != count:
                raise ModelLoadError(
                    f"{self.path}: tensor '{tensor_name}' has {len(values)} factors;"
                    f" the rotary dims need {count}"
                )
            setattr(rope, name, tuple(values))

    def eos_token_ids(self) -> list[int]:
        keys = ("eos_token_id", "eot_token_id", "eom_token_id")
        ids = [self.get(f"tokenizer.ggml.{key}") for key in keys]
        return list(dict.fromkeys(i for i in ids if i is not None))

    # -- weights ----------------------------------------------------------------------------

    def tensors(self, keep_quantized: bool = False) -> dict[str, torch.Tensor | QuantizedWeight]:
        """Every weight under its Hugging Face name: dequantized, or with `keep_quantized`,
        Q8_0/Q4_0/Q4_1 and K-quant matrices kept in their blocks (`QuantizedWeight`) and
        F16/BF16 ones at 16 bits."""
        heads = self.arch_int("attention.head_count")
        kv_heads = self.arch_int("attention.head_count_kv", heads)
        out = {}
        for name, hf_name in self._hf_names():
            tensor = self._tensor(name)
            weight = self._weight(tensor, keep_quantized)
            if self.architecture == "llama" and ".attn_q." in name:
                weight = unpermute_rows(weight, heads)
            elif self.architecture == "llama" and ".attn_k." in name:
                weight = unpermute_rows(weight, kv_heads)
            if self.architecture == "gemma3" and ".ffn_norm." in name:  # the MLP's input
                hf_name = hf_name.replace(".post_attention_", ".pre_feedforward_")
            if self.architecture == "phi3" and hf_name.endswith(".mlp.up_proj.weight"):
                hf_name = hf_name.replace(".up_proj.", ".gate_up_proj.")  # gate and up fused
            out[hf_name] = weight
        out.update(self._expert_weights(keep_quantized))
        return out

    def _expert_weights(self, keep_quantized: bool) -> dict[str, torch.Tensor | QuantizedWeight]:
        """Each [experts, rows, cols] tensor as one matrix per expert, each loaded as a 2-D
        tensor of its type would be (a view of the file where it stays in its blocks)."""
        out = {}
        for name, tensor in self._tensors.items():
            match = _LAYER_NAME.fullmatch(name)
            if match is None or match.group(2) not in _EXPERT_TENSORS:
                continue
            if len(tensor.shape) != 3:
                raise ModelLoadError(
                    f"{self.path}: tensor '{name}' has shape {tuple(reversed(tensor.shape))};"
                    " expert tensors are [experts, rows, columns]"
                )
            layer, part = match.group(1), _EXPERT_TENSORS[match.group(2)]
            for e in range(int(tensor.shape[2])):
                expert = _ExpertSlice(
                    tensor.name, tensor.tensor_type, tensor.shape[:2], tensor.data[e]
                )
                weight = self._weight(expert, keep_quantized)
                out[f"model.layers.{layer}.mlp.experts.{e}.{part}.weight"] = weight
        return out

    def _weight(self, tensor: Any, keep_quantized: bool) -> torch.Tensor | QuantizedWeight:
        kind = tensor.tensor_type.name
        if keep_quantized and (kind in GGUF_KINDS or kind in GGUF_K_KINDS):
            return self._blocks(tensor)
        if keep_quantized and kind in SIXTEEN_BIT and len(tensor.shape) == 2:
            return _sixteen_bit(tensor.data, kind)
        weight = torch.from_numpy(self._dequantize(tensor))
        if (
            keep_quantized
            and kind not in FLOAT_TYPES
            and weight.dim() == 2
            and weight.shape[1] % 32 == 0
        ):
            return quantize_q8_0(weight)  # a type without a kind of its own: 8 bits keep it close
        return weight

    def _blocks(self, tensor: Any) -> QuantizedWeight:
        rows, cols = (int(n) for n in reversed(tensor.shape))
        try:
            if tensor.tensor_type.name in GGUF_K_KINDS:
                return from_gguf_kquant(tensor.data, tensor.tensor_type.name, (rows, cols))
            return from_gguf_blocks(tensor.data, tensor.tensor_type.name, (rows, cols))
        except (ValueError, TypeError) as exc:
            raise ModelLoadError(f"{self.path}: tensor '{tensor.name}' is damaged ({exc})") from exc

    def _hf_names(self) -> Iterator[tuple[str, str]]:
        for name in self._tensors:
            if name in LONGROPE_FACTORS:
                continue
            if name == ROPE_FREQS or any(f".{part}." in name for part in _EXPERT_TENSORS):
                continue  # expert tensors: _expert_weights
            hf_name = hf_tensor_name(name)
            if hf_name is None:
                raise ModelLoadError(f"{self.path}: tensor '{name}' is not one zerohop knows")
            yield name, hf_name

    def _tensor(self, name: str) -> Any:
        tensor = self._tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{self.path}: tensor '{name}' not found")
        return tensor

    def _dequantize(self, tensor: Any) -> np.ndarray:
        from gguf import quants

        kind = tensor.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"{self.path}: tensor '{tensor.name}' has type {kind}, which zerohop cannot"
                f" load; supported: {', '.join(SUPPORTED_TYPES)}"
            )
        shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists dims innermost first
        try:
            values = quants.dequantize(tensor.data, tensor.tensor_type)
            return np.asarray(values, dtype=np.float32).reshape(shape)
        except (ValueError, TypeError) as exc:
            raise ModelLoadError(f"{self.path}: tensor '{tensor.name}' is damaged ({exc})") from exc


@dataclass(frozen=True, slots=True)
class _ExpertSlice:
    """One expert's matrix of a 3-D expert tensor, with the reader's tensor fields."""

    name: str
    tensor_type: Any
    shape: Any  # ggml order, innermost first: (cols, rows)
    data: np.ndarray


def _sixteen_bit(data: np.ndarray, kind: str) -> torch.Tensor:
    """An F16 or BF16 matrix as a torch view of the file's bytes (no copy, no widening):
    the reader gives F16 as float16 and BF16 as raw bytes."""
    raw = np.ascontiguousarray(data).view(np.uint16)
    return torch.from_numpy(raw).view(SIXTEEN_BIT[kind])


def hf_tensor_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_TENSORS:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_TENSORS[part]}.{kind}"


def gguf_tensor_name(hf_name: str) -> str:
    """The GGUF name of a Hugging Face tensor name (itself when there is none)."""
    if expert := _EXPERT_NAME.fullmatch(hf_name):
        part = {hf: name for name, hf in _EXPERT_TENSORS.items()}.get(expert[3], expert[3])
        return f"blk.{expert[1]}.{part}.weight (expert {expert[2]})"
    for gguf_name, name in _GLOBAL_TENSORS.items():
        if name == hf_name:
            return gguf_name
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf_name)
    parts = {hf_part: part for part, hf_part in _LAYER_TENSORS.items()}
    if match is None or match.group(2) not in parts:
        return hf_name
    layer, hf_part, kind = match.groups()
    return f"blk.{layer}.{parts[hf_part]}.{kind}"


def unpermute_rows(weight: WeightT, num_heads: int) -> WeightT:
    """Undo convert_hf_to_gguf's `permute` of q/k rows (interleaved rotary halves per head)."""
    if isinstance(weight, QuantizedWeight):
        order = unpermute_rows(torch.arange(weight.shape[0]), num_heads)
        return weight.permute_rows(order)
    rows = weight.shape[0]
    half = rows // num_heads // 2
    grouped = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return grouped.transpose(1, 2).reshape(weight.shape).contiguous()


@cache
def _reader_class() -> type:
    from gguf import GGUFReader

    class PlainArrayReader(GGUFReader):
        """GGUFReader over a plain ndarray view of its mapping. The reader slices its data
        once per metadata value (~1M times for a 49k-token vocabulary); on an np.memmap every
        slice pays memmap's __array_finalize__, which made opening SmolLM2 4x slower."""

        @property  # type: ignore[override]  # the reader's memmap attribute, as a plain view
        def data(self) -> np.ndarray:
            return self._plain_data

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain_data = value.view(np.ndarray)

    return PlainArrayReader


def _field_value(field: Any) -> Any:
    """A metadata value as plain Python: str, int, float, bool or a list of them."""
    from gguf import GGUFValueType

    value = field.contents()
    if field.types and field.types[0] == GGUFValueType.ARRAY:
        return list(value)
    return value
