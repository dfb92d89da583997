"""`--engine {auto,zerohop,vllm}`: which engine serves, and the flags that belong to one
engine only, refused at start for the other (never silently ignored)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
from typing import Any

ENGINES = ("auto", "zerohop", "vllm")
# zerohop's engine flags vLLM has no counterpart for: refused with --engine vllm when set.
ZEROHOP_ONLY = {
    "inter_token_target": "--inter-token-target",
    "batch_linger": "--batch-linger",
    "debug_step_delay": "--debug-step-delay",
}
ZEROHOP_QUANTIZATION = ("auto", "q8_0", "none")


def add_vllm_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("vLLM's engine (--engine vllm; vLLM's own argument names)")
    g.add_argument(
        "--engine",
        choices=ENGINES,
        default="auto",
        help="zerohop: zerohop's engine (CPU kernels); vllm: vLLM's engine (AsyncLLM) in this"
        " process; auto: vllm where CUDA and vLLM are installed, zerohop otherwise",
    )
    g.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N")
    g.add_argument("--pipeline-parallel-size", type=int, default=None, metavar="N")
    g.add_argument("--data-parallel-size", type=int, default=None, metavar="N")
    g.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="SHARE")
    g.add_argument(
        "--distributed-executor-backend",
        choices=["mp", "ray", "uni", "external_launcher"],
        default=None,
        help="vLLM's executor (ray: multi-node)",
    )
    g.add_argument(
        "--kv-events-config",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="vLLM's KV cache events (for llm-d's KV-aware routing), e.g."
        ' \'{"enable_kv_cache_events": true, "publisher": "zmq"}\'',
    )
    g.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        type=_vllm_arg,
        metavar="NAME=VALUE",
        help="any other field of vLLM's AsyncEngineArgs (VALUE read as JSON when it parses,"
        " else a string), e.g. --vllm-arg swap_space=8; repeat for more",
    )


def chosen_engine(name: str) -> str:
    """`auto` resolved: vllm where a CUDA device answers and vLLM imports."""
    if name != "auto":
        return name
    return "vllm" if _cuda_present() and importlib.util.find_spec("vllm") else "zerohop"


def vllm_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's own arguments, by AsyncEngineArgs field name."""
    named = {
        "tensor_parallel_size": args.tensor_parallel_size,
        "pipeline_parallel_size": args.pipeline_parallel_size,
        "data_parallel_size": args.data_parallel_size,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "distributed_executor_backend": args.distributed_executor_backend,
        "kv_events_config": args.kv_events_config,
    }
    chosen = {name: value for name, value in named.items() if value is not None}
    return chosen | dict(args.vllm_arg)


def check_engine_flags(
    engine: str, args: argparse.Namespace, defaults: dict[str, Any]
) -> str | None:
    """Why the flags given cannot run on `engine`; None when they can."""
    if engine == "vllm":
        if importlib.util.find_spec("vllm") is None:
            return "--engine vllm needs vLLM: pip install 'zerohop[vllm]'"
        for dest, flag in ZEROHOP_ONLY.items():
            if getattr(args, dest) != defaults.get(dest):
                return f"{flag} is a setting of zerohop's engine; vLLM's engine has none"
        return None
    if vllm_arguments(args):
        return "vLLM's engine arguments (--tensor-parallel-size ...) need --engine vllm"
    if args.quantization not in ZEROHOP_QUANTIZATION:
        allowed = ", ".join(ZEROHOP_QUANTIZATION)
        return f"--quantization {args.quantization}: zerohop's engine takes {allowed}"
    return None


def _cuda_present() -> bool:
    try:
        found = subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return found.returncode == 0 and b"GPU" in found.stdout


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON object")
    return value


def _vllm_arg(text: str) -> tuple[str, Any]:
    name, sep, raw = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError("NAME=VALUE with NAME a field of AsyncEngineArgs")
    try:
        value: Any = json.loads(raw)
    except ValueError:
        value = raw
    return name, value
