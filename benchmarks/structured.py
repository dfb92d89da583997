"""What structured outputs cost, and whether they hold, on zerohop's default model
(SmolLM2-135M-Instruct) against one `zerohop serve` (--num-threads 2, --max-num-seqs 64),
driven over OpenAI /v1/chat/completions, non-streaming, from an aiohttp client:

  throughput  at concurrency 1 and 32, the same chat prompts x 128 output tokens, unconstrained
              (ignore_eos) against `response_format` json_schema with a schema that cannot end
              within 128 tokens (an array of at least 100 people), so both run to max_tokens;
              every constrained response is checked for 128 completion tokens and "length".
              --repeats rounds (2) alternate the modes; each mode counts at its best round.
              Target: constrained / unconstrained output tokens/s >= 0.90 at 32.
  compile     in-process: json_schema_grammar + GrammarCompiler on the model's tokenizer, a
              schema never seen (a new `title`) against the same one again, median of 20; and
              served: a max_tokens=1 request's time, unconstrained vs a new schema vs the same
              schema again, median of --ttft-reps (10) each.
  validity    64 requests at concurrency 32 with a realistic person schema (strict), varied
              prompts, temperature 0.7, seed i, max_tokens 256: every "stop" answer goes through
              json.loads + jsonschema; "length" counts as truncated. Target: 100% of the finished
              ones valid. Then 8 through the openai SDK's chat.completions.parse(Pydantic model).

    .venv/bin/python benchmarks/structured.py [--repeats 2] [--out bench-results/structured.json]
    .venv/bin/python benchmarks/structured.py --requests 4 --concurrency 2 --repeats 1  # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Annotated, Any, Literal

import aiohttp
import jsonschema
import openai
import pydantic
from _common import ROOT, model_path, print_table, write_json
from serve import SERVED_MODEL_NAME, Server

MAX_TOKENS, VALID_TOKENS, TARGET = 128, 256, 0.90
STREET = ("street", "city", "zip")
ADDRESS = {"type": "object", "properties": {k: {"type": "string"} for k in STREET},
           "required": list(STREET), "additionalProperties": False}  # fmt: skip
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "format": "email"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": ADDRESS,
    },
    "required": ["name", "age", "email", "role", "tags", "address"],
    "additionalProperties": False,
}
SMALL = {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}}
PEOPLE = {"type": "array", "minItems": 100,  # never complete within MAX_TOKENS
          "items": {"type": "object", "properties": SMALL, "required": list(SMALL)}}  # fmt: skip


class Address(pydantic.BaseModel):
    street: str
    city: str
    zip: str


class Person(pydantic.BaseModel):
    name: Annotated[str, pydantic.Field(max_length=40)]
    age: Annotated[int, pydantic.Field(ge=0, le=120)]
    email: Annotated[str, pydantic.Field(json_schema_extra={"format": "email"})]
    role: Literal["admin", "editor", "viewer"]
    tags: Annotated[list[str], pydantic.Field(max_length=5)]
    address: Address


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="default: zerohop's default model")
    p.add_argument("--threads", type=int, default=2, help="engine threads")
    p.add_argument("--repeats", type=int, default=2, help="throughput rounds; best counts")
    p.add_argument("--requests", type=int, default=None, help="per run (default 4 at c=1, 2c)")
    p.add_argument("--concurrency", default="1,32", help="throughput concurrencies; the largest "
                   "also runs the validity check")  # fmt: skip
    p.add_argument("--ttft-reps", type=int, default=10)
    p.add_argument("--compile-reps", type=int, default=20)
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "structured.json")
    args = p.parse_args()
    args.levels = [int(c) for c in args.concurrency.split(",")]
    args.max_num_batched_tokens = 2048  # serve.Server's engine option
    return args


def chat(prompt: str, max_tokens: int, schema: dict | None = None, **extra: Any) -> dict:
    body = {"model": SERVED_MODEL_NAME, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, **extra}  # fmt: skip
    if schema is None:
        return body | {"ignore_eos": True}
    fmt = {"name": "bench", "schema": schema, "strict": True}
    return body | {"response_format": {"type": "json_schema", "json_schema": fmt}}


async def post_all(url: str, bodies: list[dict], concurrency: int) -> tuple[float, list[dict]]:
    """Wall time of all `bodies` at `concurrency`; each response's JSON with its `_seconds`
    (or `_error`)."""
    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(body: dict) -> dict:
            async with gate:
                start = time.perf_counter()
                async with session.post(url + "/v1/chat/completions", json=body) as r:
                    text = await r.text()
                out = json.loads(text) if r.status == 200 else {"_error": f"{r.status} {text}"}
                return out | {"_seconds": time.perf_counter() - start}

        start = time.perf_counter()
        results = await asyncio.gather(*(one(b) for b in bodies))
    return time.perf_counter() - start, results


def post(url: str, bodies: list[dict], concurrency: int = 1) -> tuple[float, list[dict]]:
    return asyncio.run(post_all(url, bodies, concurrency))


def finish(r: dict) -> str:
    return r["choices"][0]["finish_reason"] if "choices" in r else "error"


def throughput_run(url: str, args: argparse.Namespace, c: int, mode: str, rnd: int) -> dict:
    n = args.requests or (4 if c == 1 else 2 * c)
    schema = PEOPLE if mode == "constrained" else None
    bodies = [chat(f"List the people of town {rnd}-{i} as JSON.", MAX_TOKENS, schema)
              for i in range(n)]  # fmt: skip
    wall, results = post(url, bodies, c)
    tokens = sum(r.get("usage", {}).get("completion_tokens", 0) for r in results)
    full = sum(finish(r) == "length" and r["usage"]["completion_tokens"] == MAX_TOKENS
               for r in results)  # fmt: skip
    errors = [r["_error"][:200] for r in results if "_error" in r]
    return {"requests": n, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ran_to_max_tokens": full, "errors": errors}  # fmt: skip


def measure_throughput(url: str, args: argparse.Namespace) -> dict:
    post(url, [chat("Warm up.", 8), chat("Warm up.", 8, PEOPLE)])
    out = {}
    for c in args.levels:
        runs: dict[str, list[dict]] = {"unconstrained": [], "constrained": []}
        for rnd in range(args.repeats):  # alternate the modes, flipping the order each round
            for mode in list(runs)[:: 1 if rnd % 2 == 0 else -1]:
                runs[mode].append(run := throughput_run(url, args, c, mode, rnd))
                print(f"  c={c} {mode}: {run['tokens_per_s']:.1f} tok/s, "
                      f"{run['ran_to_max_tokens']}/{run['requests']} ran to max_tokens "
                      f"{run['errors'][:1] or ''}", flush=True)  # fmt: skip
        best = {m: max(r["tokens_per_s"] for r in rs) for m, rs in runs.items()}
        ratio = best["constrained"] / best["unconstrained"]
        out[str(c)] = {"rounds": runs, "best_tokens_per_s": best, "ratio": ratio}
    return out


def compile_times(model: Path, reps: int) -> dict:
    """Grammar text + compiled matcher, in-process (what a request costs the API process and
    the engine's compile worker): a new schema each time vs the same one again."""
    from zerohop.engine.loading.checkpoint import open_checkpoint
    from zerohop.engine.structured.compiler import GrammarCompiler
    from zerohop.engine.structured.grammar import json_schema_grammar

    checkpoint = open_checkpoint(model)
    config, tokenizer = checkpoint.config(), checkpoint.tokenizer()
    eos = sorted(set(tokenizer.eos_token_ids) | set(config.eos_token_ids))
    compiler = GrammarCompiler(tokenizer, config.vocab_size, eos)
    compiler.submit(json_schema_grammar(PEOPLE)).result()  # waits for the tokenizer index

    def timed(schema: dict) -> float:
        start = time.perf_counter()
        compiler.submit(json_schema_grammar(schema)).result()
        return 1000 * (time.perf_counter() - start)

    cold = [timed(PERSON | {"title": f"person-{i}"}) for i in range(reps)]
    cached = [timed(PERSON | {"title": "person-0"}) for _ in range(reps)]
    compiler.close()
    return {"cold_ms": statistics.median(cold), "cached_ms": statistics.median(cached)}


def served_first_token(url: str, reps: int) -> dict:
    """max_tokens=1, one at a time: unconstrained, a new schema, that schema again."""
    times: dict[str, list[float]] = {"unconstrained": [], "new_schema": [], "same_schema": []}
    for i in range(reps):
        schema = PERSON | {"title": f"served-{time.time_ns()}"}
        for kind, s in zip(times, (None, schema, schema), strict=True):
            _, [r] = post(url, [chat(f"Describe person number {kind}-{i} as JSON.", 1, s)])
            if "_error" in r:
                raise RuntimeError(f"{kind}: {r['_error'][:300]}")
            times[kind].append(1000 * r["_seconds"])
    return {f"{k}_ms": statistics.median(v) for k, v in times.items()}


def validity(url: str, n: int, concurrency: int) -> dict:
    bodies = [chat(f"Describe person number {i} as JSON.", VALID_TOKENS, PERSON,
                   temperature=0.7, seed=i) for i in range(n)]  # fmt: skip
    _, results = post(url, bodies, concurrency)
    counts = {"valid": 0, "invalid": 0, "truncated": 0, "errors": 0}
    for r in results:
        reason = finish(r)
        if reason == "stop":
            counts["valid" if valid(r["choices"][0]["message"]["content"]) else "invalid"] += 1
        else:
            counts["truncated" if reason == "length" else "errors"] += 1
    done = counts["valid"] + counts["invalid"]
    return counts | {"requests": n, "valid_share": counts["valid"] / done if done else None}


def valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), PERSON, format_checker=jsonschema.FormatChecker())
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


async def sdk_parse(url: str, n: int) -> dict:
    """The openai SDK's own structured-output path: chat.completions.parse(Person)."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

    async def one(i: int) -> str:
        try:
            done = await client.chat.completions.parse(
                model=SERVED_MODEL_NAME, response_format=Person, max_tokens=VALID_TOKENS,
                messages=[{"role": "user", "content": f"Describe person number {i} as JSON."}],
                temperature=0.7, seed=i,
            )  # fmt: skip
        except openai.LengthFinishReasonError:
            return "truncated"
        except (openai.APIError, pydantic.ValidationError):
            return "failed"
        return "parsed" if isinstance(done.choices[0].message.parsed, Person) else "failed"

    outcomes = await asyncio.gather(*(one(i) for i in range(n)))
    await client.close()
    return {k: outcomes.count(k) for k in ("parsed", "failed", "truncated")} | {"requests": n}


def summary_rows(report: dict) -> list[list[object]]:
    rows: list[list[object]] = []
    for c, t in report["throughput"].items():
        best = " / ".join(f"{v:.1f}" for v in t["best_tokens_per_s"].values())
        rows.append([f"output tok/s c={c}: free / constrained", best, f"ratio {t['ratio']:.3f}"])
    rows.append(["ratio target at the largest concurrency", f">= {TARGET}", ""])
    comp = " / ".join(f"{v:.3f}" for v in report["compile_in_process"].values())
    rows.append(["compile ms, in-process: cold / cached", comp, ""])
    first = " / ".join(f"{v:.1f}" for v in report["served_first_token"].values())
    rows.append(["served 1-token ms: free / new schema / same", first, ""])
    v, sdk = report["validity"], report["sdk_parse"]
    counts = ", ".join(f"{v[k]} {k}" for k in ("valid", "invalid", "truncated", "errors"))
    rows.append(["valid share of finished (target 1)", v["valid_share"], counts])
    counts = ", ".join(f"{sdk[k]} {k}" for k in ("failed", "truncated"))
    rows.append(["openai SDK parse()", f"{sdk['parsed']}/{sdk['requests']} parsed", counts])
    return rows


def main() -> dict:
    args = parse_args()
    model = model_path(args.model)
    print("== compile time, in-process", flush=True)
    report: dict[str, Any] = {"model": str(model), "threads": args.threads}
    report["compile_in_process"] = compile_times(model, args.compile_reps)
    server = Server(args, model, args.threads, args.out.parent / "structured-server.log")
    try:
        server.wait_ready()
        print("== throughput", flush=True)
        report["throughput"] = measure_throughput(server.url, args)
        print("== served first token; validity", flush=True)
        report["served_first_token"] = served_first_token(server.url, args.ttft_reps)
        report["validity"] = validity(server.url, args.requests or 64, max(args.levels))
        report["sdk_parse"] = asyncio.run(sdk_parse(server.url, min(8, args.requests or 8)))
    finally:
        server.stop()
    print()
    print_table(["figure", "value", "detail"], summary_rows(report))
    write_json(args.out, report)
    print(f"\nwrote {args.out}")
    return report


if __name__ == "__main__":
    main()
