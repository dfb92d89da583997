"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over the paged KV cache.

Plain tensors and functional ops rather than nn.Modules: the weights are views into the
memory-mapped safetensors files (or dequantized GGUF tensors), and a forward pass is a short,
flat sequence of kernels: torch ops, or (where they are built) zerohop's CPU kernels with each
layer's small operations fused (fused.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zerohop.engine.base.errors import ModelLoadError
from zerohop.engine.kernels import cpu_kernel
from zerohop.engine.kernels import load as load_kernels
from zerohop.engine.model.attention import AttentionBatch, CacheKernels, paged_attention
from zerohop.engine.model.config import ModelConfig, RopeConfig
from zerohop.engine.model.fused import FusedOps
from zerohop.engine.model.fused_weights import split_fused
from zerohop.engine.model.gemma3 import embed_scale, gelu_mul
from zerohop.engine.model.kquant import KQuantWeight, tied_panel_rows
from zerohop.engine.model.linear import (
    DensePanelRows,
    Linear,
    kernel_weight,
    make_dense_linear,
    make_onednn_linear,
    make_plain_linear,
    make_quantized_linear,
    make_side_by_side,
    onednn_available,
)
from zerohop.engine.model.moe import Expert, MoeBlock, silu_mul, split_stacked_experts
from zerohop.engine.model.quant import BLOCK, PanelRows, QuantizedWeight, quantize_q8_0
from zerohop.engine.model.rope import RotaryEmbedding, apply_rotary

Rope = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
_Matrix = tuple["torch.Tensor | QuantizedWeight", "torch.Tensor | None"]


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv_proj: Linear  # q, k and v stacked: one product instead of three
    qkv_sizes: tuple[int, int, int]
    o_proj: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_proj: Linear | None  # gate and up stacked; None where the MLP is `moe`
    down_proj: Linear | None
    moe: MoeBlock | None = None  # a mixture-of-experts MLP (moe.py)
    # Gemma 3: norms of the attention's and the MLP's outputs before each residual add, and
    # the layer's sliding window (0: global; its own RoPE table where local)
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    window: int = 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as transformers' LlamaRMSNorm.
    dtype = x.dtype
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(dtype)


def _normed(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return x if weight is None else rms_norm(x, weight, eps)


def _lookup_from_panels(
    embedding: torch.Tensor | QuantizedWeight | PanelRows, lm_head: Linear
) -> torch.Tensor | QuantizedWeight | PanelRows | DensePanelRows:
    """A tied q8_0 or 16-bit embedding read from its output layer's panels
    (kernels/panel_product.h, dense_gemm.h, bf16_gemm.h), so the matrix is held once; any
    other embedding as it is."""
    packed = kernel_weight(lm_head)
    if isinstance(embedding, torch.Tensor) and embedding.dtype in (torch.float16, torch.bfloat16):
        return DensePanelRows.of(packed) or embedding
    if not isinstance(embedding, QuantizedWeight) or packed is None:
        return embedding
    if isinstance(embedding, KQuantWeight) and packed.kind == f"{embedding.kind}_panels":
        return tied_panel_rows(embedding, packed.kind, packed.tensors)
    if packed.kind != "q8_0_panels" or packed.bias is not None:
        return embedding
    qs, scales = packed.tensors
    return PanelRows(embedding.shape, qs, scales)


class CausalLM:
    def __init__(
        self,
        config: ModelConfig,
        tensors: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device | str,
        source: str = "the checkpoint",
        name_in_file: Callable[[str], str] = str,
        quantization: str = "none",
        context: int | None = None,  # the positions served; LongRoPE picks its factors by it
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.quantization = quantization
        fused = split_fused(tensors, config)  # Phi-3's qkv_proj and gate_up_proj, by rows
        fused = split_stacked_experts(fused)  # [experts, rows, cols] parameters, per expert
        weights = _WeightSource(fused, dtype, self.device, source, name_in_file, quantization)
        weights.norm_offset = config.gemma3.norm_offset if config.gemma3 else 0.0
        kernels = load_kernels() if cpu_kernel("decode_attention", self.device, dtype) else None
        self.cache_kernels = (
            CacheKernels(kernels.write_kv, kernels.decode_attention, kernels.prompt_attention)
            if kernels
            else None
        )
        self.fused_ops = FusedOps.from_kernels(kernels) if kernels else None
        if self.fused_ops is not None:
            self.float_linear = make_dense_linear  # faster than oneDNN at 1-2,048 rows here
        elif onednn_available(dtype, self.device):
            self.float_linear = make_onednn_linear
        else:
            self.float_linear = make_plain_linear
        vocab, hidden = config.vocab_size, config.hidden_size
        self.embed_tokens: torch.Tensor | QuantizedWeight | PanelRows | DensePanelRows
        self.embed_tokens = weights.take_matrix("model.embed_tokens.weight", (vocab, hidden))
        self.layers = [self._load_layer(weights, i) for i in range(config.num_layers)]
        self.norm = weights.take_norm("model.norm.weight", (hidden,))
        if config.tie_word_embeddings:
            self.lm_head = self.linear(self.embed_tokens, None)
            self.embed_tokens = _lookup_from_panels(self.embed_tokens, self.lm_head)
        else:
            self.lm_head = self.linear(weights.take_matrix("lm_head.weight", (vocab, hidden)), None)
        positions, rope = config.max_position_embeddings, config.rope
        self.rotary = RotaryEmbedding(config.head_dim, positions, rope, dtype, self.device, context)
        self.scale = config.head_dim**-0.5
        self.local_rotary: RotaryEmbedding | None = None  # Gemma 3's sliding-window layers
        self.embed_scale: torch.Tensor | None = None
        if config.gemma3 is not None:
            local = RopeConfig(theta=config.gemma3.local_theta)
            self.local_rotary = RotaryEmbedding(config.head_dim, positions, local, dtype, device)
            self.scale = config.gemma3.query_pre_attn_scalar**-0.5
            self.embed_scale = embed_scale(hidden, dtype)

    def _load_layer(self, w: _WeightSource, i: int) -> LayerWeights:
        c = self.config
        p = f"model.layers.{i}."
        hidden, inter, head = c.hidden_size, c.intermediate_size, c.head_dim
        q_dim, kv_dim = c.num_heads * head, c.num_kv_heads * head
        bias, qk_norm = c.attention_bias, c.qk_norm
        q_norm_dim, k_norm_dim = (q_dim, kv_dim) if c.qk_norm_whole else (head, head)

        def matrix(name: str, out_dim: int, in_dim: int, has_bias: bool = False) -> _Matrix:
            weight = w.take_matrix(f"{p}{name}.weight", (out_dim, in_dim))
            return weight, w.take(f"{p}{name}.bias", (out_dim,)) if has_bias else None

        qkv = [
            matrix("self_attn.q_proj", q_dim, hidden, bias),
            matrix("self_attn.k_proj", kv_dim, hidden, bias),
            matrix("self_attn.v_proj", kv_dim, hidden, bias),
        ]
        moe = self._load_moe(w, p) if c.moe_layer(i) else None
        dense = ("mlp.gate_proj", "mlp.up_proj") if moe is None else ()
        gate_up = [matrix(name, inter, hidden) for name in dense]
        gemma = c.gemma3
        return LayerWeights(
            input_norm=w.take_norm(p + "input_layernorm.weight", (hidden,)),
            qkv_proj=self.stacked_linear(qkv),
            qkv_sizes=(q_dim, kv_dim, kv_dim),
            o_proj=self.linear(*matrix("self_attn.o_proj", hidden, q_dim)),
            q_norm=w.take_norm(p + "self_attn.q_norm.weight", (q_norm_dim,)) if qk_norm else None,
            k_norm=w.take_norm(p + "self_attn.k_norm.weight", (k_norm_dim,)) if qk_norm else None,
            post_norm=w.take_norm(
                p + ("pre_feedforward" if gemma else "post_attention") + "_layernorm.weight",
                (hidden,),
            ),
            gate_up_proj=self.stacked_linear(gate_up) if gate_up else None,
            down_proj=None if moe else self.linear(*matrix("mlp.down_proj", hidden, inter)),
            moe=moe,
            attn_out_norm=w.take_norm(p + "post_attention_layernorm.weight", (hidden,))
            if gemma
            else None,
            mlp_out_norm=w.take_norm(p + "post_feedforward_layernorm.weight", (hidden,))
            if gemma
            else None,
            window=gemma.window(i) if gemma else 0,
        )

    def _load_moe(self, w: _WeightSource, prefix: str) -> MoeBlock:
        experts = self.config.experts
        assert experts is not None
        hidden, inter = self.config.hidden_size, experts.intermediate_size

        def matrix(name: str, out_dim: int, in_dim: int) -> _Matrix:
            return w.take_matrix(f"{prefix}mlp.experts.{name}.weight", (out_dim, in_dim)), None

        def expert(e: int) -> Expert:
            gate_up = [matrix(f"{e}.{name}", inter, hidden) for name in ("gate_proj", "up_proj")]
            down = self.linear(*matrix(f"{e}.down_proj", hidden, inter))
            return Expert(self.stacked_linear(gate_up), down)

        # The router stays in float (as llama.cpp keeps it): a rounded logit can pick another
        # expert, where a rounded weight only moves the output a little.
        router = w.take_float(f"{prefix}mlp.gate.weight", (experts.count, hidden))
        ops = self.fused_ops
        return MoeBlock(
            router=self.float_linear(router, None),
            experts=[expert(e) for e in range(experts.count)],
            top_k=experts.used,
            norm_topk_prob=experts.norm_topk_prob,
            activation=ops.silu_mul if ops else silu_mul,
            set_decode_rows=ops.set_decode_rows if ops else None,
        )

    def stacked_linear(self, parts: list[_Matrix]) -> Linear:
        """One product for matrices that read the same input: their outputs side by side."""
        weights = [weight for weight, _ in parts]
        biases = [bias for _, bias in parts]
        bias = None if biases[0] is None else torch.cat(biases)
        if all(isinstance(weight, torch.Tensor) for weight in weights):
            return self.linear(torch.cat(weights), bias)
        if len({getattr(weight, "kind", None) for weight in weights}) == 1:
            return self.linear(QuantizedWeight.concat(weights), bias)
        return make_side_by_side([self.linear(weight, b) for weight, b in parts])  # mixed types

    def linear(self, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None) -> Linear:
        if isinstance(weight, QuantizedWeight):
            return make_quantized_linear(weight, bias)
        if weight.dtype != self.dtype:  # kept at 16 bits (_WeightSource.keeps_16_bit)
            return make_dense_linear(weight, bias)
        return self.float_linear(weight, bias)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed_tokens, (QuantizedWeight, PanelRows, DensePanelRows)):
            rows = self.embed_tokens.dequantize(input_ids)
        else:
            rows = F.embedding(input_ids, self.embed_tokens).to(self.dtype)
        return rows if self.embed_scale is None else rows * self.embed_scale

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
        if self.fused_ops is not None:
            # Decode rows come first (ModelRunner.order_chunks); the rest are prompt rows.
            self.fused_ops.set_decode_rows(attn.decode.num_seqs if attn.decode else 0)
            try:
                return self._fused_forward(
                    self.fused_ops, input_ids, positions, attn, kv_caches, logits_rows
                )
            finally:
                self.fused_ops.set_decode_rows(-1)
        eps = self.config.rms_norm_eps
        hidden = self.embed(input_ids)
        tables = [self.rotary.lookup(positions)]
        if self.local_rotary is not None:
            tables.append(self.local_rotary.lookup(positions))

        def rope(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return apply_rotary(q, k, *tables[0])

        def local_rope(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return apply_rotary(q, k, *tables[-1])

        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            normed = rms_norm(hidden, layer.input_norm, eps)
            turn = local_rope if layer.window else rope
            out = self.attention(layer, normed, turn, attn, k_cache, v_cache)
            hidden = hidden + _normed(out, layer.attn_out_norm, eps)
            normed = rms_norm(hidden, layer.post_norm, eps)
            hidden = hidden + _normed(self.mlp(layer, normed), layer.mlp_out_norm, eps)
        last = rms_norm(hidden[logits_rows], self.norm, eps)
        return self.lm_head(last).float()

    def kernel_inputs(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the kernels take for a step: contiguous hidden states, and cos and sin [T, D]."""
        hidden = self.embed(input_ids).contiguous()
        cos = self.rotary.cos.index_select(0, positions)
        sin = self.rotary.sin.index_select(0, positions)
        return hidden, cos, sin

    def _fused_forward(
        self,
        ops: FusedOps,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        """`forward` on zerohop's CPU kernels: the same math, with each layer's small
        operations fused (fused.py), so a decode step is ~10 kernel calls a layer instead of
        ~40 torch ops."""
        eps = self.config.rms_norm_eps
        hidden, cos, sin = self.kernel_inputs(input_ids, positions)
        layers = self.layers
        decode_rows = attn.decode.num_seqs if attn.decode else 0

        def turner(cos: torch.Tensor, sin: torch.Tensor) -> Rope:
            def rope(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                # In place: q and k are fresh views of this layer's qkv; a partial rotary turns
                # only the leading dims that cos and sin cover.
                rotary = cos.shape[-1]
                ops.rotate(q[..., :rotary], cos, sin)
                ops.rotate(k[..., :rotary], cos, sin)
                return q, k

            return rope

        rope = local_rope = turner(cos, sin)
        if self.local_rotary is not None:
            local = self.local_rotary
            local_rope = turner(local.cos[positions], local.sin[positions])

        def fused_norm(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
            return x if weight is None else ops.rms_norm(x, weight, eps, None)

        normed = ops.rms_norm(hidden, layers[0].input_norm, eps, None)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(layers, kv_caches, strict=True)):
            turn = local_rope if layer.window else rope
            attended = self.attention(layer, normed, turn, attn, k_cache, v_cache)
            attended = fused_norm(attended, layer.attn_out_norm)
            normed = ops.rms_norm(attended, layer.post_norm, eps, hidden)  # hidden += attended
            mlp = fused_norm(self.mlp(layer, normed, decode_rows), layer.mlp_out_norm)
            if i + 1 < len(layers):
                normed = ops.rms_norm(mlp, layers[i + 1].input_norm, eps, hidden)  # hidden += mlp
            else:
                hidden += mlp
        last = ops.rms_norm(hidden.index_select(0, logits_rows), self.norm, eps, None)
        return self.lm_head(last)

    def mlp(self, layer: LayerWeights, x: torch.Tensor, decode_rows: int = -1) -> torch.Tensor:
        """One layer's MLP, dense or mixture of experts; x's first `decode_rows` rows are
        decodes (-1: all of them)."""
        if layer.moe is not None:
            return layer.moe(x, decode_rows)
        assert layer.gate_up_proj is not None and layer.down_proj is not None
        if self.config.gemma3 is not None:
            activation = self.fused_ops.gelu_mul if self.fused_ops else gelu_mul
        else:
            activation = self.fused_ops.silu_mul if self.fused_ops else silu_mul
        return layer.down_proj(activation(layer.gate_up_proj(x)))

    def attention(
        self,
        layer: LayerWeights,
        x: torch.Tensor,
        rope: Rope,
        attn: AttentionBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """One layer's attention block; `rope(q, k)` returns q and k rotated."""
        cfg = self.config
        n = x.shape[0]
        q, k, v = layer.qkv_proj(x).split(layer.qkv_sizes, dim=-1)
        if layer.q_norm is not None and cfg.qk_norm_whole:  # over all heads at once (OLMoE)
            q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
        q = q.view(n, cfg.num_heads, cfg.head_dim)
        k = k.view(n, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(n, cfg.num_kv_heads, cfg.head_dim)
        if layer.q_norm is not None and not cfg.qk_norm_whole:
            q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
        q, k = rope(q, k)
        out = paged_attention(
            q, k, v, k_cache, v_cache, attn, self.scale, self.cache_kernels, layer.window
        )
        return layer.o_proj(out)


class _WeightSource:
    """Hands out named tensors in the model's dtype and device, with clear errors; matrices
    stay (or become) block-quantized as the quantization mode says."""

    def __init__(
        self,
        tensors: dict[str, torch.Tensor | QuantizedWeight],
        dtype: torch.dtype,
        device: torch.device,
        source: str,
        name_in_file: Callable[[str], str],
        quantization: str,
    ) -> None:
        self.tensors, self.dtype, self.device, self.source = tensors, dtype, device, source
        self.name_in_file = name_in_file
        self.quantization = quantization
        self.norm_offset = 0.0  # Gemma's RMSNorm multiplies by (1 + w): 1.0 from its folders

    def take_norm(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A norm's weight, with the offset added in float32 (Gemma3RMSNorm's 1 + w)."""
        if not self.norm_offset:
            return self.take(name, shape)
        weight = self._find(name, shape)
        assert isinstance(weight, torch.Tensor), f"{name} is a vector"
        return (weight.float() + self.norm_offset).to(dtype=self.dtype, device=self.device)

    def take_matrix(self, name: str, shape: tuple[int, int]) -> torch.Tensor | QuantizedWeight:
        weight = self._find(name, shape)
        if isinstance(weight, QuantizedWeight):
            if self.quantization == "none":
                return weight.dequantize().to(dtype=self.dtype, device=self.device)
            return weight
        if self.quantization == "q8_0" and shape[1] % BLOCK == 0:
            return quantize_q8_0(weight)
        if self.keeps_16_bit(weight):
            return weight.contiguous()
        return self.take(name, shape)

    def take_float(self, name: str, shape: tuple[int, int]) -> torch.Tensor:
        """A matrix in the model's dtype, whatever the file stores it as."""
        weight = self._find(name, shape)
        if isinstance(weight, QuantizedWeight):
            return weight.dequantize().to(dtype=self.dtype, device=self.device)
        return self.take(name, shape)

    def keeps_16_bit(self, weight: torch.Tensor) -> bool:
        """A float16/bfloat16 matrix stays at 16 bits where the dense kernel (widening in
        registers, exact) multiplies it: half the memory and the bytes a decode reads."""
        return (
            weight.dtype in (torch.float16, torch.bfloat16)
            and self.quantization == "auto"
            and weight.shape[-1] % 8 == 0
            and cpu_kernel("dense_linear", self.device, self.dtype) is not None
        )

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
