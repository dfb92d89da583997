"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over the paged KV cache.

Plain tensors and functional ops rather than nn.Modules: the weights are views into the
memory-mapped safetensors files (or dequantized GGUF tensors), and a forward pass is a short,
flat sequence of kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zerohop.engine.attention import AttentionBatch, paged_attention
from zerohop.engine.config import ModelConfig
from zerohop.engine.errors import ModelLoadError
from zerohop.engine.linear import (
    Linear,
    make_onednn_linear,
    make_plain_linear,
    make_quantized_linear,
    onednn_available,
)
from zerohop.engine.quant import BLOCK, QuantizedWeight, quantize_q8_0
from zerohop.engine.rope import RotaryEmbedding, apply_rotary


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    gate_proj: Linear
    up_proj: Linear
    down_proj: Linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as transformers' LlamaRMSNorm.
    dtype = x.dtype
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(dtype)


class CausalLM:
    def __init__(
        self,
        config: ModelConfig,
        tensors: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device,
        source: str = "the checkpoint",
        name_in_file: Callable[[str], str] = str,
        quantization: str = "none",
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.quantization = quantization
        weights = _WeightSource(tensors, dtype, self.device, source, name_in_file, quantization)
        self.float_linear = (
            make_onednn_linear if onednn_available(dtype, self.device) else make_plain_linear
        )
        vocab, hidden = config.vocab_size, config.hidden_size
        self.embed_tokens = weights.take_matrix("model.embed_tokens.weight", (vocab, hidden))
        self.layers = [self._load_layer(weights, i) for i in range(config.num_layers)]
        self.norm = weights.take("model.norm.weight", (hidden,))
        if config.tie_word_embeddings:
            self.lm_head = self.linear(self.embed_tokens, None)
        else:
            self.lm_head = self.linear(weights.take_matrix("lm_head.weight", (vocab, hidden)), None)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope, dtype, self.device
        )
        self.scale = config.head_dim**-0.5

    def _load_layer(self, w: _WeightSource, i: int) -> LayerWeights:
        c = self.config
        p = f"model.layers.{i}."
        hidden, inter, head = c.hidden_size, c.intermediate_size, c.head_dim
        q_dim, kv_dim = c.num_heads * head, c.num_kv_heads * head
        bias, qk_norm = c.attention_bias, c.qk_norm

        def proj(name: str, out_dim: int, in_dim: int, has_bias: bool = False) -> Linear:
            weight = w.take_matrix(f"{p}{name}.weight", (out_dim, in_dim))
            return self.linear(weight, w.take(f"{p}{name}.bias", (out_dim,)) if has_bias else None)

        return LayerWeights(
            input_norm=w.take(p + "input_layernorm.weight", (hidden,)),
            q_proj=proj("self_attn.q_proj", q_dim, hidden, bias),
            k_proj=proj("self_attn.k_proj", kv_dim, hidden, bias),
            v_proj=proj("self_attn.v_proj", kv_dim, hidden, bias),
            o_proj=proj("self_attn.o_proj", hidden, q_dim),
            q_norm=w.take(p + "self_attn.q_norm.weight", (head,)) if qk_norm else None,
            k_norm=w.take(p + "self_attn.k_norm.weight", (head,)) if qk_norm else None,
            post_norm=w.take(p + "post_attention_layernorm.weight", (hidden,)),
            gate_proj=proj("mlp.gate_proj", inter, hidden),
            up_proj=proj("mlp.up_proj", inter, hidden),
            down_proj=proj("mlp.down_proj", hidden, inter),
        )

    def linear(self, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None) -> Linear:
        if isinstance(weight, QuantizedWeight):
            return make_quantized_linear(weight, bias)
        return self.float_linear(weight, bias)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed_tokens, QuantizedWeight):
            return self.embed_tokens.dequantize(input_ids)
        return F.embedding(input_ids, self.embed_tokens)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Run the flat batch; return float32 logits for the rows in `logits_rows`."""
        eps = self.config.rms_norm_eps
        hidden = self.embed(input_ids)
        rotary = self.rotary.lookup(positions)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            normed = rms_norm(hidden, layer.input_norm, eps)
            hidden = hidden + self._attention(layer, normed, rotary, attn, k_cache, v_cache)
            normed = rms_norm(hidden, layer.post_norm, eps)
            gate = F.silu(layer.gate_proj(normed)) * layer.up_proj(normed)
            hidden = hidden + layer.down_proj(gate)
        last = rms_norm(hidden[logits_rows], self.norm, eps)
        return self.lm_head(last).float()

    def _attention(
        self,
        layer: LayerWeights,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        cfg = self.config
        n = x.shape[0]
        q = layer.q_proj(x).view(n, cfg.num_heads, cfg.head_dim)
        k = layer.k_proj(x).view(n, cfg.num_kv_heads, cfg.head_dim)
        v = layer.v_proj(x).view(n, cfg.num_kv_heads, cfg.head_dim)
        if layer.q_norm is not None:
            q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
        q, k = apply_rotary(q, k, *rotary)
        out = paged_attention(q, k, v, k_cache, v_cache, attn, self.scale)
        return layer.o_proj(out)


class _WeightSource:
    """Hands out named tensors in the model's dtype and device, with clear errors; matrices
    stay (or become) block-quantized as the quantization mode says."""

    def __init__(
        self,
        tensors: dict[str, torch.Tensor | QuantizedWeight],
        dtype,
        device,
        source: str,
        name_in_file: Callable[[str], str],
        quantization: str,
    ) -> None:
        self.tensors, self.dtype, self.device, self.source = tensors, dtype, device, source
        self.name_in_file = name_in_file
        self.quantization = quantization

    def take_matrix(self, name: str, shape: tuple[int, int]) -> torch.Tensor | QuantizedWeight:
        weight = self._find(name, shape)
        if isinstance(weight, QuantizedWeight):
            if self.quantization == "none":
                return weight.dequantize().to(dtype=self.dtype, device=self.device)
            return weight
        if self.quantization == "q8_0" and shape[1] % BLOCK == 0:
            return quantize_q8_0(weight)
        return self.take(name, shape)

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = self._find(name, shape)
        assert isinstance(tensor, torch.Tensor), f"{name} is a matrix: use take_matrix"
        # No copy when dtype and device already match: the tensor stays a view of the file.
        return tensor.to(dtype=self.dtype, device=self.device)

    def _find(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | QuantizedWeight:
        tensor = self.tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{self.source}: weight '{self.name_in_file(name)}' not found")
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(
                f"{self.source}: weight '{self.name_in_file(name)}' has shape"
                f" {tuple(tensor.shape)}, but"
                f" the model config implies {shape}"
            )
        return tensor
