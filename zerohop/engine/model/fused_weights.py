"""Checkpoints that store q/k/v or gate/up as one matrix (Phi-3's `qkv_proj` and
`gate_up_proj`), split by rows into the separate names the decoder reads.

The decoder stacks those parts into one product again (`CausalLM.stacked_linear`), so the
split is only a naming step: float parts are views, block-quantized parts slices of their
rows, and the stacked product holds the same rows in the same order as the file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TypeAlias

import torch

from zerohop.engine.model.config import ModelConfig
from zerohop.engine.model.quant import QuantizedWeight

Weight: TypeAlias = torch.Tensor | QuantizedWeight


def split_fused(tensors: Mapping[str, Weight], config: ModelConfig) -> dict[str, Weight]:
    """`tensors` with every fused matrix (and bias) of the expected rows replaced by its row
    ranges; one of other rows stays, and the decoder reports its parts as missing."""
    q_dim = config.num_heads * config.head_dim
    kv_dim = config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    fused = {
        "self_attn.qkv_proj": {"q_proj": q_dim, "k_proj": kv_dim, "v_proj": kv_dim},
        "mlp.gate_up_proj": {"gate_proj": inter, "up_proj": inter},
    }
    out = dict(tensors)
    for i in range(config.num_layers):
        for whole, parts in fused.items():
            for kind in ("weight", "bias"):
                name = f"model.layers.{i}.{whole}.{kind}"
                tensor = out.get(name)
                if tensor is None or tensor.shape[0] != sum(parts.values()):
                    continue
                del out[name]
                start, module = 0, f"model.layers.{i}.{whole.split('.')[0]}"
                for part, rows in parts.items():
                    out[f"{module}.{part}.{kind}"] = row_range(tensor, start, rows)
                    start += rows
    return out


def row_range(weight: Weight, start: int, rows: int) -> Weight:
    if isinstance(weight, torch.Tensor):
        return weight.narrow(0, start, rows)
    total = weight.shape[0]
    changes: dict[str, object] = {"shape": (rows, weight.shape[1])}
    for item in dataclasses.fields(weight):
        value = getattr(weight, item.name)
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == total:
            changes[item.name] = value.narrow(0, start, rows)
    return dataclasses.replace(weight, **changes)
