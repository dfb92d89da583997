"""zerohop: an LLM serving runtime with the inference gateway built in.

The root is the top of the import graph: `python -m zerohop` (__main__.py) runs zerohop.cli,
and `zerohop.LLM` / `zerohop.SamplingParams` load zerohop.engine's on first use. No module of
zerohop imports the root: each imports the package that holds what it needs (the version is
the installed distribution's, `importlib.metadata.version("zerohop")`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zerohop.engine.llm import LLM, RequestOutput
    from zerohop.engine.sample.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "__version__":  # the installed distribution's, as pyproject.toml states it
        from importlib import metadata

        return metadata.version("zerohop")
    # Lazy, so that `import zerohop.cli` or the API process need not import torch.
    if name in ("LLM", "RequestOutput"):
        from zerohop.engine import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from zerohop.engine.sample.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'zerohop' has no attribute {name!r}")
