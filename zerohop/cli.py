"""`zerohop` command line: `generate` (offline), `serve` (HTTP/gRPC, next capability)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most sequences per step")
    g.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="token budget of one step"
    )
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    g.add_argument(
        "--kv-cache-memory", type=float, default=None, help="KV cache size in GiB (CPU: 1)"
    )
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and activations (auto: float32 on CPU, bfloat16 on CUDA)",
    )
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix (KV) caching")
    g.add_argument("--num-threads", type=int, default=None, help="torch threads of the engine")


def engine_options(args: argparse.Namespace) -> dict:
    return {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": args.block_size,
        "kv_cache_memory": args.kv_cache_memory,
        "dtype": args.dtype,
        "enable_prefix_caching": not args.no_prefix_caching,
        "num_threads": args.num_threads,
    }


def resolve_model_dir(model_dir: str | None) -> Path:
    if model_dir:
        return Path(model_dir)
    from zerohop.models.default import default_model_dir

    return default_model_dir()


def cmd_generate(args: argparse.Namespace) -> int:
    from zerohop import LLM, SamplingParams

    llm = LLM(resolve_model_dir(args.model), **engine_options(args))
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerohop", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text offline from one prompt")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--model", help="Hugging Face model folder (default: embedded model)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    add_engine_options(gen)
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
