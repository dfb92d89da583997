"""`open_checkpoint`: which format a path is, and the model name it gets by default."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from zerohop.engine.base.errors import ModelLoadError
from zerohop.engine.loading.checkpoint import (
    HFCheckpoint,
    model_name_from_file,
    open_checkpoint,
)


@pytest.mark.parametrize(
    ("file", "name"),
    [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
        ("Llama-3.2-1B-Instruct-Q4_K_M.gguf", "Llama-3.2-1B-Instruct"),
        ("qwen2.5-0.5b-instruct-iq4_xs.gguf", "qwen2.5-0.5b-instruct"),
        ("model-bf16.gguf", "model"),
        ("tiny.F32.gguf", "tiny"),
        ("SmolLM2-135M-Instruct.gguf", "SmolLM2-135M-Instruct"),  # "-Instruct" is no type
        ("Mistral-7B-Instruct-v0.3.gguf", "Mistral-7B-Instruct-v0.3"),
    ],
)
def test_a_gguf_model_is_named_after_its_file_without_the_type(file: str, name: str) -> None:
    assert model_name_from_file(Path(file)) == name


def test_a_folder_is_a_hugging_face_checkpoint(llama_dir: Path) -> None:
    checkpoint = open_checkpoint(llama_dir)
    assert isinstance(checkpoint, HFCheckpoint) and checkpoint.name == llama_dir.name


def test_gguf_is_recognised_by_its_magic_bytes_too(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(b"GGUF" + b"\0" * 20)  # a GGUF header, cut short
    with pytest.raises(ModelLoadError, match=r"model\.bin: not a readable GGUF file"):
        open_checkpoint(path)


@pytest.mark.parametrize(("name", "content"), [("missing.gguf", None), ("notes.txt", b"hello")])
def test_what_is_neither_format_is_refused_by_name(
    tmp_path: Path, name: str, content: bytes | None
) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ModelLoadError, match=re.escape(name)):
        open_checkpoint(path)
