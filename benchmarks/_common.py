"""Helpers shared by the benchmark programs: the models, text prompts, FLOP/s, RSS (tables and
JSON are `harness.report`'s, re-exported here).

Run as a program (`python benchmarks/_common.py build FOLDER`) it builds the standard model;
the benchmarks do that in a child process so the build's memory never counts in their RSS.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

from harness.report import print_table as print_table  # noqa: E402
from harness.report import write_json as write_json  # noqa: E402

DEFAULT_MODEL_DIR = Path.home() / ".cache" / "zerohop" / "bench-models" / "llama-768"


@dataclass(slots=True, frozen=True)
class ModelShape:
    """A Llama-family model's shape; the defaults are the standard benchmark model, a
    ~125M-parameter Llama with grouped-query attention."""

    hidden: int = 768
    layers: int = 12
    heads: int = 12
    kv_heads: int = 4
    intermediate: int = 2048
    vocab: int = 32000
    max_positions: int = 4096
    head_dim: int = 64
    tied_embeddings: bool = False

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """The shape of a loaded model, from its `zerohop.engine.config.ModelConfig`."""
        return cls(
            hidden=config.hidden_size,
            layers=config.num_layers,
            heads=config.num_heads,
            kv_heads=config.num_kv_heads,
            intermediate=config.intermediate_size,
            vocab=config.vocab_size,
            max_positions=config.max_position_embeddings,
            head_dim=config.head_dim,
            tied_embeddings=config.tie_word_embeddings,
        )

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    def layer_params(self) -> int:
        """Weights of one decoder layer (projections and norms)."""
        kv = self.kv_heads * self.head_dim
        attention = 2 * self.hidden * self.q_dim + 2 * self.hidden * kv
        mlp = 3 * self.hidden * self.intermediate
        return attention + mlp + 2 * self.hidden

    def lm_head_params(self) -> int:
        """The output projection's weights (the embedding matrix itself when tied)."""
        return self.hidden * self.vocab

    def non_embedding_params(self) -> int:
        return self.layers * self.layer_params() + self.hidden + self.lm_head_params()


STANDARD = ModelShape()


def build_model(folder: Path, shape: ModelShape = STANDARD, seed: int = 0) -> None:
    """Write a random-weight float32 Llama (safetensors) and the toy tokenizer to `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from zerohop.models.toy_tokenizer import save_tokenizer

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
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


def default_model() -> Path:
    """zerohop's default model (SmolLM2-135M-Instruct, a GGUF file), fetched once with pip."""
    from zerohop.models.default import default_model_path

    return default_model_path()


def model_path(arg: str | Path | None) -> Path:
    """What a benchmark's model argument names: None, the default model; `standard`, the
    standard model (built on first use); else a .gguf file, a Hugging Face folder or `tiny`."""
    if arg is None:
        return default_model()
    if str(arg) == "standard":
        return ensure_model(None)
    from zerohop.models import resolve_model

    return resolve_model(str(arg))


def open_model(path: Path) -> tuple[Any, Any]:
    """A model's `ModelConfig` and tokenizer, read without loading its weights."""
    from zerohop.engine.loading.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(path)
    return checkpoint.config(), checkpoint.tokenizer()


# -- prompts ------------------------------------------------------------------------------------

# An English passage (written for these benchmarks) that prompts are cut from, so that prompt
# tokens are what a tokenizer makes of real text, not ids drawn at random.
PASSAGE = """\
The harbour wakes before the town does. Long before the first bus climbs the hill, the \
fishing boats come back around the breakwater, their lamps still lit, and the gulls follow \
them in a loose, complaining cloud. On the quay a handful of people wait with crates and \
hoses: the buyers from the restaurants, a man who repairs nets, two students who work the \
early shift at the ice plant. Nobody says much. The catch is lifted out, weighed, sorted by \
size and packed in ice, and by the time the sun clears the cliffs most of it is already on \
its way inland.

The town grew up around this small daily trade. The oldest houses stand close to the water, \
narrow and tall, painted in colours that were once chosen so that sailors could tell them \
apart from the sea. Behind them the streets rise in steps and ramps, too steep for cars, and \
the gardens are walled against the wind. In winter the storms can keep the boats in port \
for a week at a time; the nets are mended, the engines taken apart and cleaned, and the \
cafés fill with people who have nothing to do but argue about the weather.

Summer brings a different town. Visitors arrive on the morning train with maps and \
sunglasses, and the harbour becomes a place to be looked at rather than worked in. Some of \
the fishermen take them out along the coast to see the caves and the seals; others simply \
complain that there is nowhere to park. The bakery opens an hour earlier, the museum by the \
lighthouse stays open late, and the small cinema shows old films about the sea.

What holds the place together, people say, is the tide. Twice a day the water goes out \
across the flats and twice a day it comes back, indifferent to timetables and to tourists, \
and everything in the town is arranged around it: when the boats can leave, when the road \
to the island is dry, when the children are allowed to search the rock pools for crabs. \
Those who stay long enough stop looking at clocks and start looking at the water.
"""


class TextPrompts:
    """Prompts of exact lengths in a model's own tokens: a numbered instruction, then the
    passage from a random token on (wrapping around), cut to the wanted length.

    The instruction's random number makes every prompt's first KV block its own, so the
    prefix cache only hits where a benchmark means it to, as with random token ids.
    """

    def __init__(self, encode: Callable[[str], list[int]]) -> None:
        self.encode = encode
        self.passage = encode(PASSAGE + "\n")

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> TextPrompts:
        """For a zerohop or transformers tokenizer (both encode this way)."""
        return cls(lambda text: tokenizer.encode(text, add_special_tokens=False))

    def prompt(self, rng: random.Random, length: int) -> list[int]:
        number = rng.randrange(10**6)
        header = self.encode(f"Note {number:06d}: summarize the text below in one sentence.\n\n")
        start = rng.randrange(len(self.passage))
        body = itertools.islice(itertools.cycle(self.passage), start, start + length)
        return (header + list(body))[:length]


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


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "build":
        sys.exit("usage: _common.py build FOLDER")
    build_model(Path(sys.argv[2]))


ACTIVATIONS = ("default", "int8")


def set_activations(activations: str) -> None:
    """The quantized products' activations: `default` (16-bit per block on the panels where
    the CPU has AVX-512 VNNI, else float32) or `int8` (llama.cpp's rounding of decode rows,
    opt-in, row-major products only: not where the engine packs its weights in panels)."""
    from zerohop.engine import kernels

    if activations not in ACTIVATIONS:
        raise SystemExit(f"--activations: {activations!r} is not one of {ACTIVATIONS}")
    if not kernels.available():
        return
    ops = kernels.load()
    if activations == "int8" and ops.wide():
        raise SystemExit("--activations int8: this CPU's products run on panels, without int8")
    ops.set_integer_dots(activations == "int8")


def int_list(p: argparse.ArgumentParser, option: str, text: str) -> list[int]:
    """A comma-separated list of positive integers, in order, without repeats."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        p.error(f"{option}: comma-separated integers, not {text!r}")
    if not values or min(values) < 1:
        p.error(f"{option}: one or more integers >= 1, not {text!r}")
    return list(dict.fromkeys(values))
