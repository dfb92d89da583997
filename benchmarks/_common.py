"""Helpers shared by the benchmark programs: the standard model, machine FLOP/s, RSS, tables.

Run as a program (`python benchmarks/_common.py build FOLDER`) it builds the standard model;
the benchmarks do that in a child process so the build's memory never counts in their RSS.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

DEFAULT_MODEL_DIR = Path.home() / ".cache" / "zerohop" / "bench-models" / "llama-768"


@dataclass(slots=True, frozen=True)
class ModelShape:
    """The standard benchmark model: a ~125M-parameter Llama with grouped-query attention."""

    hidden: int = 768
    layers: int = 12
    heads: int = 12
    kv_heads: int = 4
    intermediate: int = 2048
    vocab: int = 32000
    max_positions: int = 4096

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def layer_params(self) -> int:
        """Weights of one decoder layer (projections and norms)."""
        kv = self.kv_heads * self.head_dim
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * kv
        mlp = 3 * self.hidden * self.intermediate
        return attention + mlp + 2 * self.hidden

    def lm_head_params(self) -> int:
        return self.hidden * self.vocab

    def non_embedding_params(self) -> int:
        return self.layers * self.layer_params() + self.hidden + self.lm_head_params()


STANDARD = ModelShape()


def build_model(folder: Path, shape: ModelShape = STANDARD, seed: int = 0) -> None:
    """Write a random-weight float32 Llama (safetensors) and the toy tokenizer to `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from zerohop.engine.toy_tokenizer import save_tokenizer

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions,
        initializer_range=0.02,
        tie_word_embeddings=False,
        # The toy tokenizer's ids: <s>=0, </s>=1 (pad), <|im_end|>=3 (eos).
        bos_token_id=0,
        pad_token_id=1,
        eos_token_id=3,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    tmp = folder.with_name(folder.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    save_tokenizer(tmp)
    tmp.rename(folder)


def ensure_model(folder: Path | None) -> Path:
    """The standard model's folder, built in a child process the first time."""
    folder = (folder or DEFAULT_MODEL_DIR).expanduser()
    if (folder / "config.json").exists():
        return folder
    print(f"building the standard model in {folder} ...", flush=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, __file__, "build", str(folder)], check=True)
    return folder


def set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


@dataclass(slots=True, frozen=True)
class MatmulResult:
    shape: str
    flops_per_s: float


def measure_matmul(
    shapes: Sequence[tuple[int, int, int]] = ((2048, 768, 2048), (2048, 2048, 768)),
    seconds: float = 1.0,
) -> list[MatmulResult]:
    """Dense float32 FLOP/s of `x @ w.T` (as nn.Linear does) for (tokens, in, out) shapes."""
    import torch

    results = []
    for m, k, n in shapes:
        x = torch.randn(m, k)
        w = torch.randn(n, k)
        torch.nn.functional.linear(x, w)  # warm-up
        runs, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds or runs < 3:
            torch.nn.functional.linear(x, w)
            runs += 1
        results.append(MatmulResult(f"{m}x{k} @ {k}x{n}", 2 * m * k * n * runs / elapsed))
    return results


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [[str(h) for h in headers], *[[_cell(v) for v in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for i, row in enumerate(cells):
        print(
            "  ".join(
                c.rjust(w) if j else c.ljust(w)
                for j, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if i == 0:
            print("  ".join("-" * w for w in widths))


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "build":
        sys.exit("usage: _common.py build FOLDER")
    build_model(Path(sys.argv[2]))
