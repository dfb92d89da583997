"""zerohop: an LLM serving runtime with the inference gateway built in."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

# Before torch loads OpenMP: its workers should sleep between parallel regions rather than
# spin, because zerohop's own kernel threads (zerohop/engine/kernels/spin_pool.h) and the API
# process need those cores in between. Measured offline on SmolLM2 with 2 threads: 346 ms
# prefill and 14.1 ms a token against 564 ms and 22.7 ms with spinning workers. A value the
# user set wins; if torch was loaded first, the engine keeps torch to one thread instead.
OMP_WORKERS_SLEEP = os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE" or (
    "torch" not in sys.modules and "OMP_WAIT_POLICY" not in os.environ
)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

if TYPE_CHECKING:
    from zerohop.engine.llm import LLM, RequestOutput
    from zerohop.engine.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy, so that `import zerohop.cli` or the API process need not import torch.
    if name in ("LLM", "RequestOutput"):
        from zerohop.engine import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from zerohop.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'zerohop' has no attribute {name!r}")
