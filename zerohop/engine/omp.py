"""OpenMP's wait policy, set before torch loads OpenMP (the engine package imports this first).

torch's OpenMP workers should sleep between parallel regions rather than spin, because
zerohop's own kernel threads (kernels/spin_pool.h) and the API process need those cores in
between. Measured offline on SmolLM2 with 2 threads: 346 ms prefill and 14.1 ms a token against
564 ms and 22.7 ms with spinning workers. A value the user set wins; if torch was loaded first,
the engine keeps torch to one thread instead (`WORKERS_SLEEP` is False).

Only the processes that run the engine set it: `import zerohop` and `zerohop.client` leave the
caller's environment alone.
"""

from __future__ import annotations

import os
import sys

SET_BY_USER = "OMP_WAIT_POLICY" in os.environ
# vLLM's processes (its EngineCore imports zerohop's scheduler class) keep OpenMP's defaults.
UNDER_VLLM = "ZEROHOP_UNDER_VLLM"
WORKERS_SLEEP = os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE" or (
    "torch" not in sys.modules and not SET_BY_USER
)
if os.environ.get(UNDER_VLLM) != "1":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def vllm_environment() -> None:
    """Before vLLM's processes start from this one: the wait policy as the user left it. vLLM's
    CPU workers bind a thread to each core of their own and are built for OpenMP's default
    waits, not the sleeping ones zerohop's engine wants."""
    if not SET_BY_USER:
        os.environ.pop("OMP_WAIT_POLICY", None)
    os.environ[UNDER_VLLM] = "1"
