"""The offline workloads engine_throughput.py runs, what each costs in FLOPs, and the reference
it runs them against: transformers' batched `generate` (one left-padded static batch)."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from _common import ModelShape, TextPrompts

SEED = 1234
PAD_ID = 1  # transformers' left padding; any id does, the attention mask hides it


@dataclass(slots=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)


@dataclass(slots=True)
class Run:
    seconds: float
    output_tokens: int
    flops: float
    cached_tokens: int = 0
    notes: list[str] = field(default_factory=list)
    cpu_seconds: float = 0.0  # this process's CPU time: far above 2x seconds = spinning threads
    load_average: float = 0.0  # 1-minute load average at the end: above ~threads = contended
    all_seconds: list[float] = field(default_factory=list)  # every repeat; `seconds` is the best

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    def as_dict(self, dense_flops: float) -> dict:
        return {
            **asdict(self),
            "output_tok_s": self.output_tok_s,
            "flops_per_s": self.flops / self.seconds,
            "flop_fraction": self.flops / self.seconds / dense_flops,
        }


def best_of(runs: list[Run], threads: int) -> Run:
    """The fastest repeat: on a shared machine the minimum is the least disturbed figure."""
    best = min(runs, key=lambda r: r.seconds)
    best.all_seconds = [r.seconds for r in runs]
    best.notes = sorted({n for r in runs for n in r.notes})
    cores = best.cpu_seconds / best.seconds
    if threads > 1 and cores < 0.75 * threads:
        # A quiet run keeps every thread busy; with the cores shared, torch's thread pool
        # waits on descheduled threads and a run can take several times longer.
        best.notes.append(f"even the best run used only {cores:.1f} cores: contended, rerun")
    return best


def make_workload(name: str, n: int, prompts: TextPrompts, rep: int = 0) -> Workload:
    """Lengths depend on the workload only; token ids also on the repeat."""
    rng = random.Random(f"{SEED}-{name}")
    if name == "uniform":
        lengths, outputs = [128] * n, [32] * n
    elif name == "mixed":
        lengths = [rng.randint(16, 256) for _ in range(n)]
        outputs = [rng.randint(8, 128) for _ in range(n)]
    else:
        raise ValueError(f"unknown workload {name!r}")
    ids = random.Random(f"{SEED}-{name}-{rep}")
    return Workload(name, [prompts.prompt(ids, length) for length in lengths], outputs)


def request_flops(shape: ModelShape, prompt: int, output: int, cached: int = 0) -> float:
    """Approximate FLOPs an ideal engine spends on one request.

    Every position fed through the layers costs 2 * layer params (matmuls) plus attention
    4 * heads * head_dim * context per layer (QK^T and AV). Fed positions are the uncached
    prompt and all outputs but the last. The lm_head runs only where a token is sampled
    (`output` rows). Norms, rotary, softmax and sampling are left out.
    """
    start, end = cached, prompt + output - 1
    fed = end - start
    contexts = (end * (end + 1) - start * (start + 1)) // 2  # sum of p + 1 for p in [start, end)
    linear = 2 * shape.layers * shape.layer_params() * fed + 2 * shape.lm_head_params() * output
    attention = 4 * shape.q_dim * shape.layers * contexts
    return float(linear + attention)


def workload_flops(shape: ModelShape, w: Workload, cached: Sequence[int] | None = None) -> float:
    cached = cached or [0] * len(w.prompts)
    return sum(
        request_flops(shape, len(p), m, c)
        for p, m, c in zip(w.prompts, w.max_tokens, cached, strict=True)
    )


# -- Hugging Face transformers -----------------------------------------------------------------


def load_hf(path: Path):
    """transformers' model on the same weights: a folder, or a GGUF file dequantized to float32
    (transformers needs the `gguf` and `accelerate` packages for that)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    if path.suffix.lower() == ".gguf":
        where = {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}
    else:
        where = {"pretrained_model_name_or_path": str(path)}
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run every row to max_new_tokens
    model.generation_config.pad_token_id = PAD_ID
    return model


def hf_generate(model, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, int]:
    """One left-padded static batch; returns (seconds, generated columns)."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return time.perf_counter() - start, out.shape[1] - width


def run_hf(model, w: Workload, shape: ModelShape) -> Run:
    seconds, generated = hf_generate(model, w.prompts, max(w.max_tokens))
    notes = [] if generated == max(w.max_tokens) else [f"generated {generated} columns only"]
    return Run(seconds, w.output_tokens, workload_flops(shape, w), 0, notes)
