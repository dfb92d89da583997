"""`zerohop generate`: text from one prompt, with the engine in this process."""

from __future__ import annotations

import argparse
import sys

from zerohop.cli.arg_types import (
    NONNEGATIVE_INT,
    NONNEGATIVE_NUMBER,
    POSITIVE_INT,
    Subcommands,
)
from zerohop.cli.engine_flags import (
    MODEL_HELP,
    add_engine_options,
    default_engine_threads,
    engine_options,
    resolve_model,
)


def cmd_generate(args: argparse.Namespace) -> int:
    """`zerohop generate`: one prompt through the offline `LLM`, the text on stdout."""
    from zerohop.cli.engine_choice import ZEROHOP_QUANTIZATION
    from zerohop.engine.llm import LLM
    from zerohop.engine.sample.sampling_params import SamplingParams

    if args.quantization not in ZEROHOP_QUANTIZATION:
        allowed = ", ".join(ZEROHOP_QUANTIZATION)
        raise SystemExit(f"zerohop generate: --quantization takes {allowed}")
    options = engine_options(args)
    options["num_threads"] = options["num_threads"] or default_engine_threads()
    llm = LLM(resolve_model(args.model), **options)
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    out = llm.generate(prompt, params)[0]
    print(out.text)
    print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0


def add_generate_parser(sub: Subcommands) -> None:
    gen = sub.add_parser("generate", help="generate text offline from one prompt")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--model", help=MODEL_HELP)
    gen.add_argument("--max-tokens", type=POSITIVE_INT, default=32)
    gen.add_argument("--temperature", type=NONNEGATIVE_NUMBER, default=0.0)
    gen.add_argument("--seed", type=NONNEGATIVE_INT, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    add_engine_options(gen)
    gen.set_defaults(func=cmd_generate)
