"""zerohop: an LLM serving runtime with the inference gateway built in."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zerohop.engine.llm import LLM, RequestOutput
    from zerohop.engine.sample.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy, so that `import zerohop.cli` or the API process need not import torch.
    if name in ("LLM", "RequestOutput"):
        from zerohop.engine import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from zerohop.engine.sample.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'zerohop' has no attribute {name!r}")
