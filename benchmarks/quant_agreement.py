"""How closely quantized weights track float32: greedy token agreement on a fixed prompt set.

The float32 reference (`--quantization none`, identical to transformers) answers 16 fixed chat
questions greedily; then the quantized engine predicts each next token of those answers
teacher-forced (the reference's prefix, one token out, all prefixes in one batch thanks to the
prefix cache). Reported: the share of positions where its greedy choice equals the reference's,
and how many whole answers come out identical when it generates freely.

Each mode runs with the quantized products on their default activations (16-bit per block on
AVX-512 VNNI's panels, else float32) and, with --activations default,int8, on ones rounded to
int8 too (row-major products only: not on a CPU whose products run on panels).

    .venv/bin/python benchmarks/quant_agreement.py [--model-dir M] [--modes auto,q8_0]
        [--activations default,int8]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from _common import ROOT, model_path, print_table, set_activations, set_threads, write_json

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Explain photosynthesis in one sentence.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Who wrote Romeo and Juliet?",
    "Give me a tip for sleeping better.",
    "Translate 'good morning' into Spanish.",
    "What does a CPU do?",
    "List the planets closest to the sun.",
    "Why is the sky blue?",
    "Suggest a name for a pet turtle.",
    "What is the boiling point of water in Celsius?",
    "Describe a cat in two sentences.",
    "How do I make a cup of tea?",
    "What is the largest ocean on Earth?",
]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-dir", default=None, help="a .gguf, a folder, `standard` or `tiny`")
    p.add_argument("--modes", default="auto,q8_0", help="quantization modes to compare")
    p.add_argument("--activations", default="default", help="default, int8 or default,int8")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "quant_agreement.json")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from zerohop import LLM, SamplingParams

    args = parse_args(argv)
    set_threads(args.threads)
    path = str(model_path(args.model_dir))
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    reference = LLM(path, quantization="none")
    prompts = [reference.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    answers = [out.token_ids for out in reference.generate(prompts, greedy)]
    del reference
    rows = []
    for mode in args.modes.split(","):
        llm = LLM(path, quantization=mode)
        for activations in args.activations.split(","):
            set_activations(activations)
            agree, total = teacher_forced_agreement(llm, prompts, answers)
            free = [out.token_ids for out in llm.generate(prompts, greedy)]
            identical = sum(a == b for a, b in zip(free, answers, strict=True))
            rows.append(
                {
                    "mode": mode,
                    "activations": activations,
                    "positions": total,
                    "agreement": agree / total,
                    "identical_answers": identical,
                    "answers": len(answers),
                    "sample": llm.tokenizer.decode(free[0]),
                }
            )
        set_activations("default")
        del llm
    print_table(
        ["mode", "activations", "positions", "top-1 agreement", "identical", "answer to Q1"],
        [
            [
                r["mode"],
                r["activations"],
                r["positions"],
                f"{r['agreement']:.1%}",
                f"{r['identical_answers']}/{r['answers']}",
                r["sample"][:60],
            ]
            for r in rows
        ],
    )
    write_json(args.out, {"model": path, "max_tokens": args.max_tokens, "rows": rows})
    return 0


def teacher_forced_agreement(
    llm, prompts: list[list[int]], answers: list[list[int]]
) -> tuple[int, int]:
    from zerohop import SamplingParams

    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    contexts, wanted = [], []
    for prompt, answer in zip(prompts, answers, strict=True):
        for i, token in enumerate(answer):
            contexts.append(prompt + answer[:i])
            wanted.append(token)
    got = [out.token_ids[0] for out in llm.generate(contexts, one)]
    return sum(g == w for g, w in zip(got, wanted, strict=True)), len(wanted)


if __name__ == "__main__":
    raise SystemExit(main())
