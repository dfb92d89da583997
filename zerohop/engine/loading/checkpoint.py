"""A model on disk, whichever its format: a Hugging Face folder or a GGUF file.

Each gives the same three things: the model config, the tokenizer, and the weights under
Hugging Face tensor names. `open_checkpoint` picks the format from the path.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Protocol

import torch

from zerohop.engine.base.errors import ModelLoadError
from zerohop.engine.model.config import ModelConfig
from zerohop.engine.model.quant import QuantizedWeight
from zerohop.engine.text.tokenizer import Tokenizer

# A type suffix in a GGUF file name: "SmolLM2-135M-Instruct.Q4_1", "Llama-3.2-1B-Q4_K_M",
# "qwen2-0.5b-instruct-iq4_xs", "model-bf16".
_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d\w*|TQ\d\w*|B?F16|F32)$", re.IGNORECASE)


class Checkpoint(Protocol):
    path: Path

    @property
    def name(self) -> str:
        """The model's name as clients use it by default."""
        ...

    def config(self) -> ModelConfig: ...

    def tokenizer(self) -> Tokenizer: ...

    def weights(self, keep_quantized: bool = False) -> dict[str, torch.Tensor | QuantizedWeight]:
        """Every weight under its Hugging Face name; with `keep_quantized`, quantized
        matrices may stay compact (`QuantizedWeight`)."""
        ...

    def name_in_file(self, name: str) -> str:
        """How the file names the weight the model calls `name` (for error messages)."""
        ...


class HFCheckpoint:
    """config.json, tokenizer.json (+ config files) and *.safetensors in one folder."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def name(self) -> str:
        return self.path.name

    def config(self) -> ModelConfig:
        return ModelConfig.from_dir(self.path)

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_dir(self.path)

    def weights(self, keep_quantized: bool = False) -> dict[str, torch.Tensor | QuantizedWeight]:
        from zerohop.engine.loading.safetensors_weights import load_state_dict

        return load_state_dict(self.path)

    def name_in_file(self, name: str) -> str:
        return name


class GGUFCheckpoint:
    """One GGUF file: metadata is the config and the tokenizer, tensors are dequantized."""

    def __init__(self, path: Path) -> None:
        from zerohop.engine.loading.gguf_file import GGUFFile

        self.path = path
        self.file = GGUFFile(path)

    @property
    def name(self) -> str:
        return model_name_from_file(self.path)

    def config(self) -> ModelConfig:
        return self.file.config()

    def tokenizer(self) -> Tokenizer:
        from zerohop.engine.loading.gguf_tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(self.file)

    def weights(self, keep_quantized: bool = False) -> dict[str, torch.Tensor | QuantizedWeight]:
        return self.file.tensors(keep_quantized)

    def name_in_file(self, name: str) -> str:
        from zerohop.engine.loading.gguf_file import gguf_tensor_name

        return gguf_tensor_name(name)


def model_name_from_file(path: Path) -> str:
    return _QUANT_SUFFIX.sub("", path.stem)


def open_checkpoint(path: Path | str) -> Checkpoint:
    path = Path(path)
    if path.is_dir():
        return HFCheckpoint(path)
    if path.suffix.lower() == ".gguf" or (path.is_file() and _has_gguf_magic(path)):
        return GGUFCheckpoint(path)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or folder")
    raise ModelLoadError(f"{path}: neither a Hugging Face model folder nor a GGUF file")


def _has_gguf_magic(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"
