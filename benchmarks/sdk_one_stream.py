"""One-stream TTFT and TPOT through the official OpenAI SDK: a cross-check of the load client.

`vs_llamacpp.py` drives both servers with zerohop's own load client. This program measures the
c=1 figures again with the `openai` package's streaming completions, against any server that
speaks OpenAI's /v1/completions (zerohop, llama.cpp's llama-server, vLLM), already running:

    .venv/bin/python benchmarks/sdk_one_stream.py --server zerohop=http://127.0.0.1:8000/v1 \
        --server llamacpp=http://127.0.0.1:8080/v1 [--requests 8] [--max-tokens 64]

Each server gets one warm-up request, then --requests requests one at a time, alternating
between the servers, each prompt the same English passage with a different number in front
(no shared cache entry beyond its first tokens), greedy, `ignore_eos` (both servers take it
as an extra body field). TTFT: request sent to the first text chunk; TPOT: (last chunk - first
chunk) / (chunks - 1), each chunk one token on both servers. Prints p50 of each and writes
bench-results/sdk_one_stream.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from _common import ROOT, print_table, write_json

PASSAGE = (
    "The river rose slowly through the night, and by morning the lower fields were under "
    "water. Farmers moved their animals to the hills, while the children watched from the "
    "bridge as branches and barrels drifted past. Nobody in the village could remember a "
    "flood like it, though the oldest woman said her mother had spoken of one, long ago, "
    "when the mill was still standing and the road to the town was only a track. "
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--server", action="append", required=True, help="NAME=BASE_URL (…/v1)")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "sdk_one_stream.json")
    args = p.parse_args(argv)
    args.server = [tuple(s.split("=", 1)) for s in args.server]
    if any(len(s) != 2 for s in args.server):
        p.error("--server takes NAME=BASE_URL")
    return args


def one_request(client: object, model: str, prompt: str, max_tokens: int) -> tuple[float, float]:
    """(TTFT s, TPOT s) of one streamed completion."""
    start = time.perf_counter()
    stamps = []
    stream = client.completions.create(  # type: ignore[attr-defined]
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
    return stamps[0] - start, (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)


def main(argv: Sequence[str] | None = None) -> dict:
    from openai import OpenAI

    args = parse_args(argv)
    clients = {name: OpenAI(base_url=url, api_key="none") for name, url in args.server}
    models = {name: c.models.list().data[0].id for name, c in clients.items()}
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in clients}
    for name, client in clients.items():
        one_request(client, models[name], "Warm up. " + PASSAGE, 8)
    for i in range(args.requests):
        for name, client in clients.items():
            prompt = f"Note {i}. {PASSAGE}"
            samples[name].append(one_request(client, models[name], prompt, args.max_tokens))
    rows = []
    for name, got in samples.items():
        ttft = statistics.median(s[0] for s in got) * 1e3
        tpot = statistics.median(s[1] for s in got) * 1e3
        rows.append(
            {"server": name, "model": models[name], "ttft_p50_ms": ttft, "tpot_p50_ms": tpot}
        )
    print_table(["server", "model", "TTFT p50 ms", "TPOT p50 ms"], [list(r.values()) for r in rows])
    report = {"requests": args.requests, "max_tokens": args.max_tokens, "rows": rows}
    write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
