"""bfloat16 weights: the AVX-512 BF16 product (vdpbf16ps, activations rounded to bfloat16)
against the dense kernel's exact widening path, on SmolLM2-135M's shapes, at 1, 8 and 64
rows. Prints the figures and writes them as JSON (--out).

    .venv/bin/python benchmarks/bf16_products.py --out /tmp/bf16_products.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from zerohop.engine import kernels

SHAPES = {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
ROWS = (1, 8, 64)


def best_ms(run: object, repeats: int, budget_s: float) -> float:
    assert callable(run)
    run()
    best, start = float("inf"), time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("bf16_products.json"))
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    ops = kernels.load()
    if not ops.bf16_dot():
        raise SystemExit("this CPU (or build) has no AVX-512 BF16")
    results = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k).bfloat16()
        dense, dot = ops.dense_pack(w), ops.bf16_pack(w)
        for rows in ROWS:
            x = torch.randn(rows, k)
            widen = best_ms(lambda: ops.dense_linear(x, dense, n), args.repeats, 1.0)  # noqa: B023
            bf16 = best_ms(lambda: ops.bf16_linear(x, dot, n), args.repeats, 1.0)  # noqa: B023
            row = {"matrix": name, "n": n, "k": k, "rows": rows, "widen_ms": widen}
            row |= {"bf16_dot_ms": bf16, "speedup": widen / bf16}
            results.append(row)
            print(f"{name:8} {n:6}x{k:<5} rows {rows:3}: widen {widen:8.3f} ms"
                  f"  bf16 dot {bf16:8.3f} ms  {widen / bf16:5.2f}x")  # fmt: skip
    args.out.write_text(json.dumps({"threads": ops.threads(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
