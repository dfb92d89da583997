"""The built-in tiny model: a small Llama with random weights, built deterministically.

`zerohop serve tiny` serves it with nothing to download, so tests and demos can exercise the
whole stack offline. Its weights are random (seeded), so its text is gibberish: it is never
a silent stand-in for the real default model.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

# Before torch loads OpenMP in this process: its wait policy (zerohop/engine/omp.py).
from zerohop.engine import omp  # noqa: F401

# isort: split
import torch
from safetensors.torch import save_file

from zerohop.models.cache import cache_dir
from zerohop.models.toy_tokenizer import IM_END, save_tokenizer

NAME = "zerohop-tiny-llama"
VERSION = 1
CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "torch_dtype": "float32",
}
INIT_STD = 0.2  # large enough that greedy decoding does not repeat one token


def tiny_model_dir() -> Path:
    """The tiny model's folder, built on first use (atomically, safe against races)."""
    target = cache_dir() / f"{NAME}-v{VERSION}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=target.parent))
    build(staging)
    try:
        staging.rename(target)
    except OSError:  # another process built it first
        if not (target / "model.safetensors").is_file():
            raise
    return target


def build(folder: Path) -> None:
    tokenizer = save_tokenizer(folder, vocab_size=CONFIG["vocab_size"])
    eos_id = tokenizer.token_to_id(IM_END)
    config = {**CONFIG, "bos_token_id": tokenizer.token_to_id("<s>"), "eos_token_id": eos_id}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": [eos_id]}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
    save_file(random_weights(), str(folder / "model.safetensors"), metadata={"format": "pt"})


def random_weights(seed: int = 0, c: dict[str, Any] = CONFIG) -> dict[str, torch.Tensor]:
    """Seeded normal weights and unit norms for a Llama of config `c`: deterministic
    gibberish (tests/fixtures/long_context_model.py builds its model from them too)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, head_dim = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q_dim, kv_dim = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * INIT_STD

    weights = {
        "model.embed_tokens.weight": normal(c["vocab_size"], hidden),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": normal(c["vocab_size"], hidden),
    }
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": normal(q_dim, hidden),
            p + "self_attn.k_proj.weight": normal(kv_dim, hidden),
            p + "self_attn.v_proj.weight": normal(kv_dim, hidden),
            p + "self_attn.o_proj.weight": normal(hidden, q_dim),
            p + "mlp.gate_proj.weight": normal(inter, hidden),
            p + "mlp.up_proj.weight": normal(inter, hidden),
            p + "mlp.down_proj.weight": normal(hidden, inter),
        }
    return weights
