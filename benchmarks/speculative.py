"""Speculative decoding by prompt lookup: TPOT with and without it, on the default model
(SmolLM2-135M-Instruct) behind `zerohop serve`, through the official OpenAI SDK (chat,
streamed, greedy), one request at a time, on workloads where the answer repeats its
context (an edit of a given text, a quote from a RAG context, a rename in code) and one
where it does not (a free story).

  tpot      (last content chunk - first) / (completion tokens - 1), median over --reps
  ratio     TPOT with speculation / without (below 1: faster)
  accepted  proposed tokens the model kept / proposed (zerohop_spec_decode_* on /metrics)
  same      the greedy text with speculation equals the text without

Servers run one after the other, each alone on the machine, alternating for --rounds;
the best round per server counts.

    .venv/bin/python benchmarks/speculative.py [--rounds 2] [--reps 3] [--tokens 3]
    .venv/bin/python benchmarks/speculative.py --rounds 1 --reps 1  # smoke
"""

from __future__ import annotations

import argparse
import statistics
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
from _common import ROOT, print_table, write_json
from harness.zerohop_server import ZerohopServer

PASSAGE = (
    "The lighthouse at Cape Wrath was built in 1828 by Robert Stevenson. Its light can be "
    "seen for 22 nautical miles. The keepers left in 1998, when the light was automated. "
    "Today the buildings house a small cafe that is open in the summer months. The cape "
    "is reached by a ferry and a minibus along an eleven-mile track."
)
TYPOS = (
    "Teh lighthouse at Cape Wrath was biult in 1828 by Robert Stevenson. Its light can be "
    "seen for 22 nautical miles. The keepers left in 1998, wehn the light was automated. "
    "Today the buildings house a small cafe that is open in teh summer months."
)
CODE = (
    "def total(items):\n    x = 0\n    for item in items:\n        x += item.price * item.qty\n"
    "    return x\n\n\ndef average(items):\n    x = total(items)\n    return x / len(items)\n"
)
WORKLOADS = {
    "edit": f"Correct the spelling in this text and return the whole text:\n\n{TYPOS}",
    "rag": f"Context:\n{PASSAGE}\n\nQuote, word for word, the sentences of the context "
    "about the keepers and the cafe.",
    "code": f"Rename the variable x to running_sum in this code and return all of it:\n\n{CODE}",
    "free": "Write a short story about a cat who learns to swim.",
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="default: zerohop's default model")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "speculative.json")
    return p.parse_args()


def start_server(args: argparse.Namespace, speculative: bool, log: Path) -> ZerohopServer:
    flags = ["--num-threads", str(args.threads)]
    if speculative:
        config = f'{{"method": "ngram", "num_speculative_tokens": {args.tokens}}}'
        flags += ["--speculative-config", config]
    return ZerohopServer(args.model, flags, log)


def counters(server: ZerohopServer) -> dict[str, float]:
    with urllib.request.urlopen(server.url + "/metrics", timeout=5.0) as r:
        lines = r.read().decode().splitlines()
    return {
        k: float(v) for k, v in (line.split() for line in lines if line.startswith("zerohop_spec_"))
    }


def one_request(client: openai.OpenAI, prompt: str, max_tokens: int) -> dict[str, Any]:
    stream = client.chat.completions.create(
        model="bench",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    times, text, tokens = [], "", 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    tpot = (times[-1] - times[0]) / (tokens - 1) if len(times) > 1 and tokens > 1 else None
    return {"tpot_s": tpot, "tokens": tokens, "text": text}


def run_server(args: argparse.Namespace, speculative: bool, round_: int) -> dict[str, Any]:
    name = "speculative" if speculative else "plain"
    log = args.out.parent / f"speculative-{name}-{round_}.log"
    with start_server(args, speculative, log) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        one_request(client, "Hello", 8)  # warm-up
        out: dict[str, Any] = {}
        for workload, prompt in WORKLOADS.items():
            before = counters(server)
            runs = [one_request(client, prompt, args.max_tokens) for _ in range(args.reps)]
            after = counters(server)
            drafted, accepted = (
                after.get(k, 0.0) - before.get(k, 0.0)
                for k in (
                    "zerohop_spec_decode_draft_tokens_total",
                    "zerohop_spec_decode_accepted_tokens_total",
                )
            )
            tpots = [r["tpot_s"] for r in runs if r["tpot_s"] is not None]
            out[workload] = {
                "tpot_s": statistics.median(tpots) if tpots else None,
                "tokens": runs[0]["tokens"],
                "text": runs[0]["text"],
                "accepted_share": accepted / drafted if drafted else None,
            }
            print(f"  {name} {workload}: {out[workload]['tpot_s']}", flush=True)
        return out


def best(rounds: list[dict[str, Any]], workload: str) -> dict[str, Any]:
    return min(rounds, key=lambda r: r[workload]["tpot_s"] or float("inf"))[workload]


def main() -> dict:
    args = parse_args()
    runs: dict[str, list] = {"plain": [], "speculative": []}
    for round_ in range(args.rounds):
        for speculative in (False, True):
            name = "speculative" if speculative else "plain"
            runs[name].append(run_server(args, speculative, round_))
    rows, report = [], {"threads": args.threads, "num_speculative_tokens": args.tokens}
    for workload in WORKLOADS:
        plain, spec = best(runs["plain"], workload), best(runs["speculative"], workload)
        ratio = spec["tpot_s"] / plain["tpot_s"] if spec["tpot_s"] and plain["tpot_s"] else None
        report[workload] = {
            "tpot_plain_ms": plain["tpot_s"] * 1e3,
            "tpot_speculative_ms": spec["tpot_s"] * 1e3,
            "ratio": ratio,
            "accepted_share": spec["accepted_share"],
            "tokens": spec["tokens"],
            "same_text": spec["text"] == plain["text"],
        }
        r = report[workload]
        rows.append(
            [workload, f"{r['tpot_plain_ms']:.2f}", f"{r['tpot_speculative_ms']:.2f}",
             f"{ratio:.3f}", f"{r['accepted_share'] or 0:.2f}", r["tokens"], r["same_text"]]
        )  # fmt: skip
    print_table(
        ["workload", "tpot ms", "tpot spec ms", "ratio", "accepted", "tokens", "same"], rows
    )
    write_json(args.out, report)
    print(f"\nwrote {args.out}")
    return report


if __name__ == "__main__":
    main()
