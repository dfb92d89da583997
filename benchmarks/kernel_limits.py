"""zerohop's product kernels beside this machine's measured limits, so that every kernel
figure can be quoted as a fraction of a limit. Three parts, each at --threads (default: every
core this process may use):

  memory    streaming read bandwidth (`torch.sum` over a --memory-mib float32 tensor) and
            copy bandwidth (`dst.copy_(src)`, read + write bytes counted, not the write
            allocation's extra read), torch's threads set to --threads; GB/s, best of --repeat
  compute   the peak of the instructions the kernels are built on, from a small C++ extension
            this program builds once (torch's load_inline, -O3 -march=native, cached in
            ~/.cache/zerohop/bench-kernels/<key>): 12 independent chains of one instruction
            (enough to hide its latency) on --threads std::threads at once, for about
            --seconds, best of --repeat:
              f32 FMA    vfmadd*ps zmm / ymm: 16 / 8 multiply-adds (GFLOP/s = 2 x GMAC/s)
              int16 dot  vpdpwssd zmm / ymm (AVX512_VNNI; ymm also AVX-VNNI): 32 / 16
              int8 dot   vpdpbusd zmm / ymm: 64 / 32
            A kind's peak is the faster of its widths. What the CPU (or the compiler) lacks is
            reported absent, never as zero.
  products  the kernels (zerohop.engine.kernels, on kernels.set_threads(--threads) threads) on
            the model's shapes (--model-dir, default SmolLM2-135M: hidden 576, intermediate
            1536, 30 layers, vocab 49152; read from its config, no weights loaded), random
            weights in the kernels' layouts:
              q4_1 layer    a layer's matrices as zerohop fuses them, q4_1 (qs uint8 [N, K/2],
                            d and m float32 [N, K/32]): qkv [960, 576], o [576, 576],
                            gate_up [3072, 576], down [576, 1536]
              q8_0 lm_head  the output layer, q8_0 (qs int8 [N, K], d float32 [N, K/32])
                            [49152, 576]
              f32 layer     the layer's four as float32, dense_pack'ed, through dense_linear
            at each of --rows activation rows: the time per call set (a layer's four calls, or
            one lm_head call), GMAC/s (rows x N x K a call) and its fraction of the matching
            peak: q4_1 and q8_0 on the int16 dot peak where `wide()` (16-bit activations with
            AVX-512 VNNI), on the int8 dot peak with `--activations int8`
            (set_integer_dots), else on the FMA peak; f32 on the FMA peak. At rows=1 also the
            weight bytes a call set reads (qs + d + m, or the panels) over its time, GB/s, and
            its fraction of the read bandwidth. Each kind is held in as many copies as the model
            has (30 layers; one lm_head), more where those add up to less than max(64 MiB,
            2 x L3), and every measurement cycles through the copies: the weights come from
            memory, as in a decode step, not from cache. The sets run for at least --seconds (whole
            passes), best of --repeat. Each call goes through Python (a few microseconds: the
            binding, the output tensor), which the engine's C++ decode step does not pay.

    .venv/bin/python benchmarks/kernel_limits.py [--threads N] [--rows 1,8,32,128]
        [--activations default,int8] [--repeat 5] [--seconds 0.3] [--memory-mib 512]
    .venv/bin/python benchmarks/kernel_limits.py --rows 1,8 --repeat 1 --seconds 0.05 \\
        --memory-mib 128  # smoke

Prints a table per part and writes bench-results/kernel_limits.json (--out).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from _common import (
    ROOT,
    ModelShape,
    cpu_count,
    int_list,
    model_path,
    open_model,
    print_table,
    set_threads,
    write_json,
)

MIB = 1 << 20
CHAINS = 12  # the C++ source's ZH_CHAINS
ACTIVATIONS = ("default", "int8")

# The compute part's C++ extension, built once by load_inline.
LIMITS_SOURCE = (Path(__file__).parent / "kernel_limits.cpp").read_text()


@dataclass(slots=True, frozen=True)
class Instruction:
    """One instruction the compute part runs: a `kind` of peak, the extension's function."""

    kind: str
    function: str
    name: str
    macs: int  # multiply-adds per instruction


INSTRUCTIONS = (
    Instruction("f32 FMA", "fma_zmm", "vfmadd*ps zmm", 16),
    Instruction("f32 FMA", "fma_ymm", "vfmadd*ps ymm", 8),
    Instruction("int16 dot", "dpwssd_zmm", "vpdpwssd zmm", 32),
    Instruction("int16 dot", "dpwssd_ymm", "vpdpwssd ymm", 16),
    Instruction("int8 dot", "dpbusd_zmm", "vpdpbusd zmm", 64),
    Instruction("int8 dot", "dpbusd_ymm", "vpdpbusd ymm", 32),
)


@dataclass(slots=True, frozen=True)
class Matrix:
    name: str
    out_features: int
    in_features: int


@dataclass(slots=True, frozen=True)
class Kind:
    """A call set the products part measures: matrices in one weight format, and how many
    copies of them the model holds."""

    name: str
    quantization: str  # q4_1, q8_0 or f32
    matrices: tuple[Matrix, ...]
    model_copies: int


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=cpu_count(), help="default: every core")
    p.add_argument("--rows", default="1,8,32,128", help="activation rows of the products")
    p.add_argument("--activations", default="default", help="default, int8 or both")
    p.add_argument("--model-dir", default=None, help="whose shapes (default: the default model)")
    p.add_argument("--repeat", type=int, default=5, help="best of this many runs")
    p.add_argument("--seconds", type=float, default=0.3, help="least time of one run")
    p.add_argument("--memory-mib", type=int, default=512, help="the bandwidth tensors' size")
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "kernel_limits.json")
    args = p.parse_args(argv)
    args.rows = int_list(p, "--rows", args.rows)
    args.activations = list(dict.fromkeys(a.strip() for a in args.activations.split(",")))
    if unknown := set(args.activations) - set(ACTIVATIONS):
        p.error(f"unknown --activations {sorted(unknown)}; one or both of {ACTIVATIONS}")
    for option in ("threads", "repeat", "memory_mib"):
        if getattr(args, option) < 1:
            p.error(f"--{option.replace('_', '-')} must be >= 1")
    if not args.seconds > 0:
        p.error("--seconds must be > 0")
    return args


# -- memory ---------------------------------------------------------------------------------------


def measure_memory(limits: ModuleType, mib: int, threads: int, repeat: int) -> dict[str, float]:
    """Read and copy bandwidth, GB/s, best of `repeat` (after a warm-up that faults the pages):
    `read` the higher of torch.sum's and the extension's vector loads (torch.sum alone read
    ~25% below what the products' one-row weight streams reached)."""
    import torch

    src = torch.ones(mib * MIB // 4)
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4
    summed = nbytes / _best_seconds(lambda: torch.sum(src), repeat) / 1e9
    best_loads = min(limits.stream_read(src, threads) for _ in range(repeat + 1))
    loads = nbytes / best_loads / 1e9
    copy = _best_seconds(lambda: dst.copy_(src), repeat)
    return {
        "read": max(summed, loads), "read_sum": summed, "read_loads": loads,
        "copy": 2 * nbytes / copy / 1e9,
    }  # fmt: skip


def _best_seconds(run: Callable[[], object], repeat: int) -> float:
    run()
    best = math.inf
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


# -- compute --------------------------------------------------------------------------------------


def load_limits() -> ModuleType:
    """The compute part's extension, built once per source, flags, torch and CPU."""
    import torch
    from torch.utils.cpp_extension import load_inline

    from zerohop.engine import kernels

    flags = ["-O3", "-march=native"]
    key = hashlib.sha256(
        "\0".join([LIMITS_SOURCE, *flags, torch.__version__, _cpu_flags()]).encode()
    ).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    build_dir = cache / "zerohop" / "bench-kernels" / key
    build_dir.mkdir(parents=True, exist_ok=True)
    with kernels.build_lock(build_dir):  # kernels.load() has put `ninja` on PATH
        return load_inline(
            name="zerohop_kernel_limits",
            cpp_sources=[LIMITS_SOURCE],
            functions=[i.function for i in INSTRUCTIONS] + ["compiled", "stream_read"],
            extra_cflags=flags,
            build_directory=str(build_dir),
            verbose=False,
        )


def _cpu_flags() -> str:
    return _cpuinfo("flags") or platform.processor()


def _cpuinfo(field: str) -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":")[0].strip() == field:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def measure_instruction(
    limits: ModuleType, instruction: Instruction, threads: int, seconds: float, repeat: int
) -> float | None:
    """GMAC/s of `instruction` on `threads` threads at once; None where it is not compiled in."""
    if instruction.function not in limits.compiled().split(","):
        return None
    run = getattr(limits, instruction.function)
    iterations = 1000
    while (elapsed := run(iterations, threads)) < seconds / 10:
        iterations *= 10
    iterations = max(1, int(iterations * seconds / elapsed))
    best = min(run(iterations, threads) for _ in range(repeat))
    return iterations * CHAINS * instruction.macs * threads / best / 1e9


def measure_compute(
    limits: ModuleType, threads: int, seconds: float, repeat: int
) -> tuple[list[dict], dict[str, float | None]]:
    """A row per instruction, and each kind's peak GMAC/s (None: none of its widths here)."""
    rows: list[dict] = []
    peaks: dict[str, float | None] = {}
    for instruction in INSTRUCTIONS:
        gmacs = measure_instruction(limits, instruction, threads, seconds, repeat)
        rows.append({"kind": instruction.kind, "instruction": instruction.name, "gmacs": gmacs})
        best = peaks.setdefault(instruction.kind, None)
        if gmacs is not None:
            peaks[instruction.kind] = max(gmacs, best or 0.0)
    return rows, peaks


# -- products -------------------------------------------------------------------------------------

Product = Callable[[Any], Any]  # x [rows, in_features] -> x @ W.T
CallSet = list[tuple[Product, int]]  # (product, in_features) per matrix


def model_kinds(shape: ModelShape) -> list[Kind]:
    """The layer's matrices as zerohop fuses them, and the output layer."""
    kv = shape.kv_heads * shape.head_dim
    layer = (
        Matrix("qkv", shape.q_dim + 2 * kv, shape.hidden),
        Matrix("o", shape.hidden, shape.q_dim),
        Matrix("gate_up", 2 * shape.intermediate, shape.hidden),
        Matrix("down", shape.hidden, shape.intermediate),
    )
    lm_head = (Matrix("lm_head", shape.vocab, shape.hidden),)
    return [
        Kind("q4_1 layer", "q4_1", layer, shape.layers),
        Kind("q8_0 lm_head", "q8_0", lm_head, 1),
        Kind("f32 layer", "f32", layer, shape.layers),
    ]


def random_weights(kernels: ModuleType, quantization: str, matrix: Matrix) -> tuple[Any, ...]:
    """Random weights in the kernels' layout for `quantization`."""
    import torch

    n, k = matrix.out_features, matrix.in_features
    if quantization == "q4_1":
        return torch.randint(0, 256, (n, k // 2), dtype=torch.uint8), _scales(n, k), _scales(n, k)
    if quantization == "q8_0":
        return torch.randint(-127, 128, (n, k), dtype=torch.int8), _scales(n, k)
    return (kernels.dense_pack(torch.randn(n, k) * 0.02),)


def _scales(n: int, k: int) -> Any:
    import torch

    return torch.rand(n, k // 32) * 0.01


def product(kernels: ModuleType, quantization: str, matrix: Matrix) -> tuple[Product, int]:
    """One matrix's product on random weights, and the bytes of those weights."""
    weights = random_weights(kernels, quantization, matrix)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    if quantization == "f32":
        packed, out_features = weights[0], matrix.out_features

        def dense(x: Any) -> Any:
            return kernels.dense_linear(x, packed, out_features)

        return dense, nbytes
    linear = kernels.q4_1_linear if quantization == "q4_1" else kernels.q8_0_linear
    if not kernels.wide():

        def quantized(x: Any) -> Any:
            return linear(x, *weights)

        return quantized, nbytes
    # As the engine holds them: packed once in panels (int8 activations: row-major, opt-in).
    pack = kernels.q4_1_pack if quantization == "q4_1" else kernels.q8_0_pack
    panel_linear = (
        kernels.q4_1_panel_linear if quantization == "q4_1" else kernels.q8_0_panel_linear
    )
    panels, out_features = tuple(pack(*weights)), matrix.out_features

    def on_panels(x: Any) -> Any:
        if kernels.integer_dots():
            return linear(x, *weights)
        return panel_linear(x, *panels, out_features)

    return on_panels, sum(p.numel() * p.element_size() for p in panels)


def build_sets(kernels: ModuleType, kind: Kind, cold_bytes: int) -> tuple[list[CallSet], int]:
    """The kind's copies (the model's, more until they exceed `cold_bytes`) and one's bytes."""
    first, set_bytes = _one_set(kernels, kind)
    copies = max(kind.model_copies, math.ceil(cold_bytes / set_bytes))
    return [first] + [_one_set(kernels, kind)[0] for _ in range(copies - 1)], set_bytes


def _one_set(kernels: ModuleType, kind: Kind) -> tuple[CallSet, int]:
    calls: CallSet = []
    total = 0
    for matrix in kind.matrices:
        call, nbytes = product(kernels, kind.quantization, matrix)
        calls.append((call, matrix.in_features))
        total += nbytes
    return calls, total


def seconds_per_set(sets: list[CallSet], xs: dict[int, Any], seconds: float) -> float:
    """Whole passes over the sets for at least `seconds`; the mean time of one set."""
    calls, start = 0, time.perf_counter()
    while True:
        for call_set in sets:
            for call, in_features in call_set:
                call(xs[in_features])
        calls += len(sets)
        if (elapsed := time.perf_counter() - start) >= seconds:
            return elapsed / calls


def measure_kind(
    kernels: ModuleType, kind: Kind, sets: list[CallSet], rows: int, args: argparse.Namespace
) -> float:
    """Best seconds per call set at `rows` activation rows (after a warm-up pass)."""
    import torch

    xs = {m.in_features: torch.randn(rows, m.in_features) for m in kind.matrices}
    seconds_per_set(sets, xs, 0.0)
    return min(seconds_per_set(sets, xs, args.seconds) for _ in range(args.repeat))


def peak_kind(kernels: ModuleType, kind: Kind) -> str:
    """The compute peak a kind's products run against, as the kernels are set now."""
    if kind.quantization == "f32":
        return "f32 FMA"
    if kernels.integer_dots():
        return "int8 dot"
    return "int16 dot" if kernels.wide() else "f32 FMA"


def product_row(kind: Kind, rows: int, seconds: float, set_bytes: int) -> dict:
    """A call set's time and GMAC/s; at one row also its weights' bytes and GB/s."""
    macs = rows * sum(m.out_features * m.in_features for m in kind.matrices)
    row = {"kind": kind.name, "rows": rows, "us_per_set": seconds * 1e6}
    row["gmacs"] = macs / seconds / 1e9
    row["weight_mib"] = set_bytes / MIB if rows == 1 else None
    row["weight_gbs"] = set_bytes / seconds / 1e9 if rows == 1 else None
    return row


def fractions(row: dict, peak: str, peak_gmacs: float | None, read_gbs: float) -> dict:
    """A row's figures as fractions of the limits (None where there is no figure or limit)."""
    of_peak = row["gmacs"] / peak_gmacs if peak_gmacs else None
    of_read = row["weight_gbs"] / read_gbs if row["weight_gbs"] else None
    return {"peak": peak, "of_peak": of_peak, "of_read": of_read}


def measure_products(
    kernels: ModuleType, kinds: list[Kind], peaks: dict[str, float | None], read_gbs: float,
    args: argparse.Namespace,
) -> list[dict]:  # fmt: skip
    """A row per kind, activations setting (f32: the first only) and row count."""
    out = []
    cold_bytes = max(64 * MIB, 2 * _l3_bytes())
    for kind in kinds:
        sets, set_bytes = build_sets(kernels, kind, cold_bytes)
        settings = args.activations[:1] if kind.quantization == "f32" else args.activations
        for activations in settings:
            kernels.set_integer_dots(activations == "int8")
            peak = peak_kind(kernels, kind)
            label = {"activations": _activations_label(kernels, kind), "copies": len(sets)}
            for rows in args.rows:
                seconds = measure_kind(kernels, kind, sets, rows, args)
                row = product_row(kind, rows, seconds, set_bytes) | label
                out.append(row | fractions(row, peak, peaks.get(peak), read_gbs))
        del sets
    kernels.set_integer_dots(False)
    return out


def _activations_label(kernels: ModuleType, kind: Kind) -> str:
    if kind.quantization != "f32" and kernels.integer_dots():
        return "int8"
    return "int16" if kind.quantization != "f32" and kernels.wide() else "f32"


def _l3_bytes() -> int:
    """This CPU's L3 size from sysfs (0 where it is not there)."""
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (index / "level").read_text().strip() == "3":
                size = (index / "size").read_text().strip()
                unit = {"K": 1 << 10, "M": MIB}.get(size[-1:], 1)
                return int(size.rstrip("KM")) * unit
        except (OSError, ValueError):
            continue
    return 0


# -- report ---------------------------------------------------------------------------------------


def _percent(fraction: float | None) -> str | None:
    return None if fraction is None else f"{100 * fraction:.1f}%"


def print_report(report: dict) -> None:
    memory = report["memory"]
    print(f"\nmemory, {report['threads']} threads, {report['memory_mib']} MiB tensors (GB/s)")
    print_table(["limit", "GB/s"], [["read (torch.sum)", memory["read_sum"]],
                                    ["read (vector loads)", memory["read_loads"]],
                                    ["copy (read + write)", memory["copy"]]])  # fmt: skip
    print(f"\ncompute peaks, {report['threads']} threads (-: not on this CPU)")
    print_table(
        ["kind", "instruction", "GMAC/s", "GFLOP/s", "per thread GMAC/s"],
        [_compute_cells(row, report["threads"]) for row in report["compute"]],
    )
    print(f"\nproducts, {report['threads']} threads; weights cycled through `copies` sets")
    headers = ["kind", "activations", "rows", "copies", "us / set", "GMAC/s", "peak", "of peak"]
    headers += ["MiB / set", "GB/s", "of read"]
    print_table(headers, [_product_cells(row) for row in report["products"]])


def _compute_cells(row: dict, threads: int) -> list[object]:
    gmacs = row["gmacs"]
    flops = 2 * gmacs if gmacs is not None and row["kind"] == "f32 FMA" else None
    per_thread = gmacs / threads if gmacs is not None else None
    return [row["kind"], row["instruction"], gmacs, flops, per_thread]


def _product_cells(row: dict) -> list[object]:
    return [
        row["kind"], row["activations"], row["rows"], row["copies"], row["us_per_set"],
        row["gmacs"], row["peak"], _percent(row["of_peak"]), row["weight_mib"],
        row["weight_gbs"], _percent(row["of_read"]),
    ]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    set_threads(args.threads)
    from zerohop.engine import kernels as kernel_build

    kernels = kernel_build.load()  # builds them if needed; raises KernelsUnavailable if not
    kernels.set_threads(args.threads)
    model = model_path(args.model_dir)
    shape = ModelShape.from_config(open_model(model)[0])
    print(f"{_cpuinfo('model name') or platform.machine()}, {args.threads} threads, model {model}")
    limits = load_limits()
    memory = measure_memory(limits, args.memory_mib, args.threads, args.repeat)
    compute, peaks = measure_compute(limits, args.threads, args.seconds, args.repeat)
    products = measure_products(kernels, model_kinds(shape), peaks, memory["read"], args)
    report = {
        "cpu": _cpuinfo("model name"), "threads": args.threads, "model": str(model),
        "l3_mib": _l3_bytes() / MIB, "memory_mib": args.memory_mib, "wide": kernels.wide(),
        "memory": memory, "compute": compute, "peaks": peaks, "products": products,
    }  # fmt: skip
    print_report(report)
    write_json(args.out, report)
    print(f"\nwrote {args.out}")
    return report


if __name__ == "__main__":
    main()
