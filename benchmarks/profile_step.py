"""Where one engine step's time goes: prefill and decode, at batch 1, 8 and 32.

The engine's own functions are wrapped with wall-clock timers (CPU ops are synchronous, so
wall time is their cost), and each step is split into:
  linear       the q/k/v/o and MLP projections (the weight-reading matrix products)
  lm_head      the output projection (vocab x hidden), only at sampled rows
  attention    paged attention (cache write, gather, softmax-weighted sum)
  norms        RMSNorm (inputs, post-attention, final, q/k norms)
  rope         rotary embedding application
  embedding    the token-embedding lookup
  sampling     the sampler (greedy here) and logprob work
  c++ step     a decode step run as one C++ call (kernels/decode_step.h: every layer and the
               output layer, not split further); --enforce-eager splits the Python pass instead
  other        the rest: SiLU x up, residual adds, batch building, scheduling, Python
The timer wrappers themselves cost ~0.3 us a call (~300 calls a step for SmolLM2): counted
in `other`. Prompts are token ids, 128 each; decode steps are measured after every request's
prefill is done.

With --activations default,int8 the quantized products alternate between the default
activations (16-bit per block on AVX-512 VNNI's panels, else float32) and ones rounded to int8
(opt-in, row-major products only: not on a CPU whose products run on panels), pass by pass,
for a side-by-side comparison in one process.

    .venv/bin/python benchmarks/profile_step.py [--model-dir M] [--threads 1] [--batches 1,8,32]
        [--enforce-eager] [--activations default,int8] [--passes 1]
"""

from __future__ import annotations

import argparse
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _common import ROOT, model_path, print_table, set_activations, set_threads, write_json

CATEGORIES = (
    "linear", "lm_head", "attention", "norms", "rope", "embedding", "sampling", "c++ step"
)  # fmt: skip
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-dir", default=None, help="a .gguf, a folder, `standard` or `tiny`")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the served default)")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--quantization", default="auto", help="auto, q8_0 or none (float32)")
    p.add_argument(
        "--enforce-eager", action="store_true", help="decode on the Python pass (split it)"
    )
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=10, help="decode steps measured")
    p.add_argument(
        "--activations",
        default="default",
        help="default, int8 or both (default,int8), alternated (int8: row-major products only)",
    )
    p.add_argument("--passes", type=int, default=1, help="measured passes per batch and setting")
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "profile_step.json")
    return p.parse_args(argv)


class StepTimers:
    """Accumulates seconds per category while installed on an engine."""

    def __init__(self) -> None:
        self.seconds: Counter[str] = Counter()

    def wrap(self, category: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        seconds = self.seconds

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[category] += time.perf_counter() - start

        return timed

    def install(self, engine: Any) -> None:
        import zerohop.engine.model.decoder as model_module

        model = engine.model
        for layer in model.layers:
            for name in PROJECTIONS:
                setattr(layer, name, self.wrap("linear", getattr(layer, name)))
        model.lm_head = self.wrap("lm_head", model.lm_head)
        model_module.rms_norm = self.wrap("norms", model_module.rms_norm)
        model_module.apply_rotary = self.wrap("rope", model_module.apply_rotary)
        model_module.paged_attention = self.wrap("attention", model_module.paged_attention)
        model_module.F = _FunctionalWithTimedEmbedding(self)
        model.embed = self.wrap("embedding", model.embed)
        if model.fused_ops is not None:  # the CPU kernels' fused forward pass
            ops = model.fused_ops
            ops.rms_norm = self.wrap("norms", ops.rms_norm)
            ops.rotate = self.wrap("rope", ops.rotate)
        engine.sampler = self.wrap("sampling", engine.sampler)
        step = engine.runner.decode_step
        if step is not None:
            step.run = self.wrap("c++ step", step.run)


class _FunctionalWithTimedEmbedding:
    """torch.nn.functional as model.py sees it, with `embedding` timed."""

    def __init__(self, timers: StepTimers) -> None:
        import torch.nn.functional as F

        self._functional = F
        self.embedding = timers.wrap("embedding", F.embedding)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._functional, name)


def measure_batch(
    llm: Any, timers: StepTimers, batch: int, args: argparse.Namespace, seed: int
) -> list[dict]:
    from zerohop import SamplingParams

    engine = llm.engine
    vocab = engine.model_config.vocab_size
    rng = random.Random(seed)  # new prompts each pass: no prefix-cache hits in the prefill
    params = SamplingParams(temperature=0, max_tokens=args.decode_steps + 4, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(10, vocab) for _ in range(args.prompt_tokens)]
        engine.add_request(f"profile-{batch}-{i}", prompt, params)
    rows = []
    prefill_tokens = 0
    while any(seq.num_computed_tokens < len(seq.prompt_token_ids) for seq in _running(engine)):
        tokens = _pending_prompt_tokens(engine)
        rows.append(_timed_step(engine, timers, batch, "prefill", min(tokens, _budget(engine))))
        prefill_tokens += rows[-1]["tokens"]
    for _ in range(args.decode_steps):
        if not engine.has_unfinished():
            break
        rows.append(_timed_step(engine, timers, batch, "decode", batch))
    while engine.has_unfinished():
        engine.step()
    return rows


def _running(engine: Any) -> list[Any]:
    return list(engine.requests.values())


def _pending_prompt_tokens(engine: Any) -> int:
    return sum(len(s.prompt_token_ids) - s.num_computed_tokens for s in _running(engine))


def _budget(engine: Any) -> int:
    return engine.config.max_num_batched_tokens


def _timed_step(engine: Any, timers: StepTimers, batch: int, phase: str, tokens: int) -> dict:
    timers.seconds.clear()
    start = time.perf_counter()
    engine.step()
    total = time.perf_counter() - start
    parts = {c: timers.seconds.get(c, 0.0) for c in CATEGORIES}
    parts["other"] = max(0.0, total - sum(parts.values()))
    return {"batch": batch, "phase": phase, "tokens": tokens, "seconds": total, "parts": parts}


def summarize(rows: list[dict]) -> list[dict]:
    """Per (batch, phase, activations): the median step and its split, in ms and % of it."""
    out = []
    keys = sorted(
        {(r["batch"], r["phase"], r.get("activations", "default")) for r in rows},
        key=lambda k: (k[0], k[1] != "prefill", k[2]),
    )
    for batch, phase, activations in keys:
        group = sorted((r for r in rows if (r["batch"], r["phase"], r.get("activations", "default"))
                        == (batch, phase, activations)), key=lambda r: r["seconds"])  # fmt: skip
        median = group[len(group) // 2]
        step_ms = median["seconds"] * 1000
        row = {"batch": batch, "phase": phase, "activations": activations}
        row |= {"tokens": median["tokens"], "step ms": step_ms}
        for name, seconds in median["parts"].items():
            row[name] = f"{seconds * 1000:.1f} ({100 * seconds / median['seconds']:.0f}%)"
        out.append(row)
    return out


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    set_threads(args.threads)
    from zerohop import LLM

    model = model_path(args.model_dir)
    llm = LLM(
        model,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        kv_cache_memory=1.0,
        quantization=args.quantization,
        enforce_eager=args.enforce_eager,
    )
    timers = StepTimers()
    timers.install(llm.engine)
    rows = []
    settings = args.activations.split(",")
    for batch in (int(b) for b in args.batches.split(",")):
        measure_batch(llm, timers, batch, args, seed=2 * batch)  # warm this shape up once
        for i in range(args.passes):
            for activations in settings:
                set_activations(activations)
                seed = 1000 * i + 2 * batch + 1
                for row in measure_batch(llm, timers, batch, args, seed=seed):
                    rows.append({**row, "activations": activations})
    set_activations("default")
    table = summarize(rows)
    print(f"model {model}, {args.threads} threads; median step of each kind, ms (% of the step)")
    headers = list(table[0])
    print_table(headers, [[row[h] for h in headers] for row in table])
    report = {"model": str(model), "threads": args.threads, "summary": table, "steps": rows}
    write_json(args.out, report)
    print(f"\nwrote {args.out}")
    return report


if __name__ == "__main__":
    main()
