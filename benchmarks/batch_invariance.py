"""Same answer under any load (issue 40): the share of requests whose tokens are identical
alone, batched and in staggered arrivals, per weight format, and what it costs in throughput,
A/B against a previous commit in the same run.

The engine in this process (the offline API, no HTTP: the figures are the engine's), the
default model (SmolLM2-135M-Instruct, Q4_1 GGUF) with its tokenizer, --threads (2) threads.
--prompts (32) prompts of 16-400 tokens cut from an English passage in the model's own tokens
(every fourth one behind a shared 200-token instruction, so the prefix cache hits), each
answering --max-tokens (48) tokens with ignore_eos, greedy and seeded (temperature 1, top_p
0.9, a seed per prompt). Weight formats: the file as shipped (Q4_1) and --quantization none
(its weights dequantized to float32 on load: the F32 compute path); --formats to choose.

Per format and sampling:
  alone      each prompt by itself, one after another, prefix cache off: the reference
  together   all at once (one batched prefill of up to 2,048 tokens a step, then the batch's
             decodes), on a fresh engine
  cached     all at once again on that engine: every prompt from the prefix cache
  staggered  one new request every 3 engine steps with 64-token steps (long prompts split
             into chunks beside other requests' decodes), on a fresh engine
  identical  of each mode: the share of prompts whose tokens equal `alone`'s
Throughput: output tokens/s of the `together` greedy run (32 streams at once, the engine's
c=32), and the `alone` one's tokens/s (c=1, one after another).

--baseline REF also runs the same measurement on commit REF (a temporary git worktree whose
`zerohop` package the child process imports; its kernels build on first use), alternating
current and baseline --rounds (2) times, and prints baseline / current per figure.

    .venv/bin/python benchmarks/batch_invariance.py                     # this checkout
    .venv/bin/python benchmarks/batch_invariance.py --baseline HEAD~3   # A/B

Writes bench-results/batch_invariance.json (--out): every round's figures, the environment.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CHECKOUT = Path(os.environ.get("ZEROHOP_CHECKOUT", ROOT))  # whose zerohop the child measures
sys.path.insert(0, str(CHECKOUT))

SHARED = 200  # tokens of the instruction every fourth prompt starts with


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--formats", default="q4_1,f32", help="q4_1 (as shipped), f32 (dequantized)")
    p.add_argument("--baseline", help="a commit to A/B against, alternating")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "batch_invariance.json")
    return p.parse_args()


def make_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    sys.path.insert(1, str(ROOT / "benchmarks"))
    from _common import TextPrompts

    text = TextPrompts.for_tokenizer(tokenizer)
    rng = random.Random(40)
    shared = text.prompt(rng, SHARED)
    out = []
    for i in range(count):
        own = text.prompt(rng, rng.randrange(16, 400 - SHARED if i % 4 == 0 else 400))
        out.append(shared + own if i % 4 == 0 else own)
    return out


def sampling(kind: str, i: int, max_tokens: int) -> Any:
    from zerohop import SamplingParams

    if kind == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return SamplingParams(temperature=1.0, top_p=0.9, seed=1000 + i, max_tokens=max_tokens,
                          ignore_eos=True)  # fmt: skip


def run_alone(llm: Any, prompts: list[list[int]], kind: str, n: int) -> list[list[int]]:
    return [llm.generate([p], sampling(kind, i, n))[0].token_ids for i, p in enumerate(prompts)]


def run_together(llm: Any, prompts: list[list[int]], kind: str, n: int) -> list[list[int]]:
    params = [sampling(kind, i, n) for i in range(len(prompts))]
    return [out.token_ids for out in llm.generate(prompts, params)]


def run_staggered(llm: Any, prompts: list[list[int]], kind: str, n: int) -> list[list[int]]:
    engine, tokens = llm.engine, {f"s{i}": [] for i in range(len(prompts))}
    waiting, steps = list(enumerate(prompts)), 0
    while waiting or engine.has_unfinished():
        if waiting and steps % 3 == 0:
            i, prompt = waiting.pop(0)
            engine.add_request(f"s{i}", prompt, sampling(kind, i, n))
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.new_token_ids)
        steps += 1
    return [tokens[f"s{i}"] for i in range(len(prompts))]


def share(got: list[list[int]], want: list[list[int]]) -> float:
    return sum(g == w for g, w in zip(got, want, strict=True)) / len(want)


def timed(run: Any, *args: Any) -> tuple[list[list[int]], float]:
    started = time.perf_counter()
    tokens = run(*args)
    return tokens, sum(map(len, tokens)) / (time.perf_counter() - started)


def measure_format(model: Path, quantization: str, args: argparse.Namespace) -> dict[str, Any]:
    from zerohop import LLM
    from zerohop.engine.loading.checkpoint import open_checkpoint

    base = dict(num_threads=args.threads, quantization=quantization, num_kv_blocks=2048)
    prompts = make_prompts(open_checkpoint(model).tokenizer(), args.prompts)
    n, out = args.max_tokens, {}
    for kind in ("greedy", "seeded"):
        want, alone_tps = timed(run_alone, LLM(model, **base, enable_prefix_caching=False),
                                prompts, kind, n)  # fmt: skip
        fresh = LLM(model, **base)
        together, together_tps = timed(run_together, fresh, prompts, kind, n)
        cached = run_together(fresh, prompts, kind, n)
        staggered = run_staggered(LLM(model, **base, max_num_batched_tokens=64), prompts, kind, n)
        out[kind] = {
            "identical": {"together": share(together, want), "cached": share(cached, want),
                          "staggered": share(staggered, want)},
            "alone_tok_s": round(alone_tps, 1), "together_tok_s": round(together_tps, 1),
        }  # fmt: skip
    return out


def child(args: argparse.Namespace) -> None:
    from zerohop.models.default import default_model_path

    model = default_model_path()
    quantization = {"q4_1": "auto", "f32": "none"}
    result = {f: measure_format(model, quantization[f], args) for f in args.formats.split(",")}
    print(json.dumps(result))


def run_child(tree: Any, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--prompts", str(args.prompts),
           "--max-tokens", str(args.max_tokens), "--threads", str(args.threads),
           "--formats", args.formats]  # fmt: skip
    env = tree.env(ZEROHOP_CHECKOUT=str(tree.path))
    done = subprocess.run(cmd, env=env, cwd=tree.path, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the measurement in {tree.path} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def print_round(label: str, figures: dict[str, Any]) -> None:
    for fmt, kinds in figures.items():
        for kind, f in kinds.items():
            same = ", ".join(f"{mode} {value:.0%}" for mode, value in f["identical"].items())
            print(f"  {label:8} {fmt:5} {kind:7} identical: {same}; tok/s alone"
                  f" {f['alone_tok_s']}, together {f['together_tok_s']}")  # fmt: skip


def main() -> None:
    args = parse_args()
    if args.child:
        child(args)
        return
    from harness import ab  # the parent only: a child imports its own tree's zerohop

    rounds: list[dict[str, Any]] = []
    with ab.trees(args.baseline) as sides:
        for r, tree in ab.alternating(args.rounds if args.baseline else 1, sides):
            label = "baseline" if tree.commit else "current"
            print(f"round {r + 1}: {tree.name}")
            figures = run_child(tree, args)
            print_round(label, figures)
            rounds.append({"round": r + 1, "label": label, "figures": figures})
    if args.baseline:
        print_ratios(rounds)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "rounds": rounds, "commit": commit, "baseline": args.baseline, "cpus": os.cpu_count(),
        "load_average": os.getloadavg(), "args": {k: str(v) for k, v in vars(args).items()},
    }, indent=2))  # fmt: skip
    print(f"wrote {args.out}")


def print_ratios(rounds: list[dict[str, Any]]) -> None:
    """current / baseline of each throughput figure, over the rounds' means."""

    def mean(label: str, fmt: str, kind: str, figure: str) -> float:
        values = [r["figures"][fmt][kind][figure] for r in rounds if r["label"] == label]
        return sum(values) / len(values)

    first = rounds[0]["figures"]
    for fmt, kinds in first.items():
        for kind in kinds:
            for figure in ("alone_tok_s", "together_tok_s"):
                cur, old = mean("current", fmt, kind, figure), mean("baseline", fmt, kind, figure)
                print(f"  {fmt:5} {kind:7} {figure:15} current / baseline {cur / old:.3f}"
                      f" ({cur:.1f} / {old:.1f})")  # fmt: skip


if __name__ == "__main__":
    main()
