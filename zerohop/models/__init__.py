"""The models zerohop knows by name: the default (SmolLM2, fetched once) and `tiny`.
Imports only engine (for the tiny model's tokenizer and weights)."""

from __future__ import annotations

from pathlib import Path

from zerohop.models.cache import cache_dir as cache_dir

TINY = "tiny"


def resolve_model(model: str | None) -> Path:
    """What a `MODEL` argument names: a path, `tiny`, or (None) the default model."""
    if model is None:
        from zerohop.models.default import default_model_path

        return default_model_path()
    path = Path(model)
    if model == TINY and not path.exists():
        from zerohop.models.tiny import tiny_model_dir

        return tiny_model_dir()
    return path
