"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over the paged KV cache.

Plain tensors and functional ops rather than nn.Modules: the weights are views into the
memory-mapped safetensors files, and a forward pass is a short, flat sequence of kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from zerohop.engine.attention import AttentionBatch, paged_attention
from zerohop.engine.config import ModelConfig
from zerohop.engine.errors import ModelLoadError
from zerohop.engine.rope import RotaryEmbedding
from zerohop.engine.weights import load_state_dict


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    q_proj: torch.Tensor
    k_proj: torch.Tensor
    v_proj: torch.Tensor
    o_proj: torch.Tensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    gate_proj: torch.Tensor
    up_proj: torch.Tensor
    down_proj: torch.Tensor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as transformers' LlamaRMSNorm.
    dtype = x.dtype
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(dtype)


class CausalLM:
    def __init__(self, config: ModelConfig, model_dir: Path, dtype: torch.dtype, device) -> None:
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        weights = _WeightSource(load_state_dict(model_dir), dtype, self.device, model_dir)
        vocab, hidden = config.vocab_size, config.hidden_size
        self.embed_tokens = weights.take("model.embed_tokens.weight", (vocab, hidden))
        self.layers = [self._load_layer(weights, i) for i in range(config.num_layers)]
        self.norm = weights.take("model.norm.weight", (hidden,))
        if config.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = weights.take("lm_head.weight", (vocab, hidden))
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
        return LayerWeights(
            input_norm=w.take(p + "input_layernorm.weight", (hidden,)),
            q_proj=w.take(p + "self_attn.q_proj.weight", (q_dim, hidden)),
            k_proj=w.take(p + "self_attn.k_proj.weight", (kv_dim, hidden)),
            v_proj=w.take(p + "self_attn.v_proj.weight", (kv_dim, hidden)),
            o_proj=w.take(p + "self_attn.o_proj.weight", (hidden, q_dim)),
            q_bias=w.take(p + "self_attn.q_proj.bias", (q_dim,)) if bias else None,
            k_bias=w.take(p + "self_attn.k_proj.bias", (kv_dim,)) if bias else None,
            v_bias=w.take(p + "self_attn.v_proj.bias", (kv_dim,)) if bias else None,
            q_norm=w.take(p + "self_attn.q_norm.weight", (head,)) if qk_norm else None,
            k_norm=w.take(p + "self_attn.k_norm.weight", (head,)) if qk_norm else None,
            post_norm=w.take(p + "post_attention_layernorm.weight", (hidden,)),
            gate_proj=w.take(p + "mlp.gate_proj.weight", (inter, hidden)),
            up_proj=w.take(p + "mlp.up_proj.weight", (inter, hidden)),
            down_proj=w.take(p + "mlp.down_proj.weight", (hidden, inter)),
        )

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
        hidden = F.embedding(input_ids, self.embed_tokens)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            normed = rms_norm(hidden, layer.input_norm, eps)
            hidden = hidden + self._attention(layer, normed, positions, attn, k_cache, v_cache)
            normed = rms_norm(hidden, layer.post_norm, eps)
            gate = F.silu(F.linear(normed, layer.gate_proj)) * F.linear(normed, layer.up_proj)
            hidden = hidden + F.linear(gate, layer.down_proj)
        last = rms_norm(hidden[logits_rows], self.norm, eps)
        return F.linear(last, self.lm_head).float()

    def _attention(
        self,
        layer: LayerWeights,
        x: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        cfg = self.config
        n = x.shape[0]
        q = F.linear(x, layer.q_proj, layer.q_bias).view(n, cfg.num_heads, cfg.head_dim)
        k = F.linear(x, layer.k_proj, layer.k_bias).view(n, cfg.num_kv_heads, cfg.head_dim)
        v = F.linear(x, layer.v_proj, layer.v_bias).view(n, cfg.num_kv_heads, cfg.head_dim)
        if layer.q_norm is not None:
            q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
        q, k = self.rotary(positions, q, k)
        out = paged_attention(q, k, v, k_cache, v_cache, attn, self.scale)
        return F.linear(out, layer.o_proj)


class _WeightSource:
    """Hands out named tensors in the model's dtype and device, with clear errors."""

    def __init__(self, tensors: dict[str, torch.Tensor], dtype, device, model_dir: Path) -> None:
        self.tensors, self.dtype, self.device, self.model_dir = tensors, dtype, device, model_dir

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = self.tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{self.model_dir}: weight '{name}' not found in *.safetensors")
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(
                f"{self.model_dir}: weight '{name}' has shape {tuple(tensor.shape)}, but"
                f" config.json implies {shape}"
            )
        # No copy when dtype and device already match: the tensor stays a view of the file.
        return tensor.to(dtype=self.dtype, device=self.device)
