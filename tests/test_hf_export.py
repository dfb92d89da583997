"""GGUF -> Hugging Face folder for vLLM's engine (zerohop/models/hf_export.py).

A tiny llama written as llama.cpp would (tests/fixtures/tiny_gguf.py) is exported once per
vocabulary kind; the folder must read back as the file: the same config and the same weights
(zerohop's reader of each), the same token ids and chat template as zerohop's tokenizer of the
file, and the same greedy tokens in transformers as transformers on the file itself. The
cache: a second call converts nothing, a changed file gets a new folder, a folder passes
through. The real default model (SmolLM2) is checked the same way, as a slow test.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.fixtures.tiny_gguf import (
    GgufContents,
    bpe_vocab,
    gguf_contents,
    hf_gguf_greedy,
    spm_vocab,
    write_contents,
)
from tests.fixtures.tiny_models import BOS_ID, build_tiny_model
from zerohop.engine.base.errors import ModelLoadError
from zerohop.engine.loading.checkpoint import open_checkpoint
from zerohop.engine.model.config import ModelConfig
from zerohop.engine.text.tokenizer import Tokenizer
from zerohop.models import hf_export
from zerohop.models.hf_export import ExportError, export_folder, hf_folder_for

QT = gguf.GGMLQuantizationType
VT = gguf.GGUFValueType
VOCABS = ["bpe", "spm"]
EOT_ID = 3  # an extra end token the `spm` file names (tokenizer.ggml.eot_token_id)

TEXTS = [
    "Hello, world!",
    "",
    " leading and trailing spaces ",
    "Café naïve résumé 日本語 🙂🚀",
    "digits 0 12 345 6789 3.14159",
    "line one\nline two\n\n\ttabbed  double  spaced\r\n",
    "special tokens inline: <|im_start|>user\nhi<|im_end|></s> <s>",
]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Héllo 🙂, what is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "日本語で?"},
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A cache of this module's own (XDG_CACHE_HOME), so exports start from nothing."""
    home = tmp_path_factory.mktemp("xdg_cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(home))
        yield home / "zerohop" / "models" / hf_export.EXPORT_DIR


@pytest.fixture(scope="module")
def bpe_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama as a Hugging Face folder (its byte-level BPE vocabulary)."""
    return build_tiny_model(tmp_path_factory.mktemp("hf_export_llama") / "llama", "llama")


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory: pytest.TempPathFactory, bpe_folder: Path) -> dict[str, Path]:
    """The tiny llama as a GGUF file per vocabulary: `bpe` (byte-level BPE, Q4_0 weights)
    and `spm` (SentencePiece BPE, Q8_0 weights, an extra end token). One file per folder."""
    root = tmp_path_factory.mktemp("hf_export_models")
    spm = spm_vocab()
    spm_folder = build_tiny_model(root / "llama-spm", "llama", vocab_size=len(spm))
    spm_contents = gguf_contents(spm_folder, QT.Q8_0, vocab=spm)
    spm_contents.put("tokenizer.ggml.eot_token_id", EOT_ID, VT.UINT32)
    return {
        "bpe": write_contents(
            gguf_contents(bpe_folder, QT.Q4_0, vocab=bpe_vocab(bpe_folder)),
            root / "bpe" / "tiny-llama.Q4_0.gguf",
        ),
        "spm": write_contents(spm_contents, root / "spm" / "tiny-llama-spm.Q8_0.gguf"),
    }


@pytest.fixture(scope="module")
def exported(cache: Path, tiny_files: dict[str, Path]) -> dict[str, Path]:
    return {kind: hf_folder_for(path) for kind, path in tiny_files.items()}


def test_the_export_is_a_cached_folder_named_after_the_file(
    cache: Path, tiny_files: dict[str, Path], exported: dict[str, Path]
) -> None:
    for kind, folder in exported.items():
        assert folder == export_folder(tiny_files[kind])
        assert folder.parent == cache and folder.name.startswith(tiny_files[kind].stem + "-")
        names = {p.name for p in folder.iterdir()}
        assert {"config.json", "generation_config.json", "model.safetensors"} <= names
        assert {"tokenizer.json", "tokenizer_config.json"} <= names
        assert "chat_template.jinja" not in names  # the template has one home
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no staging left


@pytest.mark.parametrize("kind", VOCABS)
def test_config_reads_back_as_the_file(
    tiny_files: dict[str, Path], exported: dict[str, Path], kind: str
) -> None:
    raw = json.loads((exported[kind] / "config.json").read_text())
    assert "quantization_config" not in raw
    assert raw["architectures"] == ["LlamaForCausalLM"]
    assert raw.get("dtype", raw.get("torch_dtype")) == "float32"
    ours = open_checkpoint(tiny_files[kind]).config()
    theirs = ModelConfig.from_dir(exported[kind])
    same = {"eos_token_ids": [], "torch_dtype": None}
    assert dataclasses.replace(theirs, **same) == dataclasses.replace(ours, **same)


@pytest.mark.parametrize("kind", VOCABS)
def test_weights_are_the_file_dequantized(
    tiny_files: dict[str, Path], exported: dict[str, Path], kind: str
) -> None:
    """Exactly zerohop's reading of the file: names, the Q/K row order, every value."""
    saved = load_file(str(exported[kind] / "model.safetensors"))
    ours = open_checkpoint(tiny_files[kind]).weights()
    assert set(saved) == set(ours)
    for name, tensor in saved.items():
        want = ours[name]
        assert isinstance(want, torch.Tensor)
        assert tensor.dtype == torch.float32 and torch.equal(tensor, want.float()), name


@pytest.mark.parametrize("qtype", ["F16", "BF16"])
def test_a_16_bit_file_exports_in_its_type(
    cache: Path, bpe_folder: Path, tmp_path: Path, qtype: str
) -> None:
    """Its matrices exactly; its F32 vectors (norms) rounded to the type, as vLLM would."""
    path = write_contents(gguf_contents(bpe_folder, QT[qtype]), tmp_path / f"tiny.{qtype}.gguf")
    folder = hf_folder_for(path)
    dtype = {"F16": torch.float16, "BF16": torch.bfloat16}[qtype]
    raw = json.loads((folder / "config.json").read_text())
    assert raw.get("dtype", raw.get("torch_dtype")) == str(dtype).removeprefix("torch.")
    saved = load_file(str(folder / "model.safetensors"))
    ours = open_checkpoint(path).weights()
    assert set(saved) == set(ours)
    for name, tensor in saved.items():
        want = ours[name]
        assert isinstance(want, torch.Tensor)
        assert tensor.dtype == dtype and torch.equal(tensor, want.to(dtype)), name


def test_greedy_tokens_match_transformers_on_the_file(
    tiny_files: dict[str, Path], exported: dict[str, Path]
) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(exported["bpe"]).eval()
    config = GenerationConfig(do_sample=False, max_new_tokens=8, eos_token_id=None, pad_token_id=0)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    for n in (5, 23):
        prompt = [BOS_ID, *(int(i) for i in rng.integers(4, vocab, n))]
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        got = out[0, len(prompt) :].tolist()
        assert got == hf_gguf_greedy(tiny_files["bpe"], prompt, 8), f"prompt of {len(prompt)}"


@pytest.mark.parametrize("kind", VOCABS)
def test_tokenizer_and_chat_template_match_zerohops_reading_of_the_file(
    tiny_files: dict[str, Path], exported: dict[str, Path], kind: str
) -> None:
    from transformers import AutoTokenizer

    ours = open_checkpoint(tiny_files[kind]).tokenizer()
    theirs = AutoTokenizer.from_pretrained(exported[kind])  # what vLLM loads
    folder = Tokenizer.from_dir(exported[kind])  # zerohop's reading of the folder
    for text in TEXTS:
        want = ours.encode(text)
        assert theirs(text)["input_ids"] == want == folder.encode(text), f"{kind}: {text!r}"
        plain = ours.encode(text, add_special_tokens=False)
        assert theirs(text, add_special_tokens=False)["input_ids"] == plain, f"{kind}: {text!r}"
        assert theirs.decode(want, skip_special_tokens=True) == ours.decode(want), text
    reader = gguf.GGUFReader(tiny_files[kind])
    template = reader.fields["tokenizer.chat_template"].contents()
    config = json.loads((exported[kind] / "tokenizer_config.json").read_text())
    assert config["chat_template"] == template == theirs.chat_template == ours.chat_template
    for generation_prompt in (True, False):
        want = ours.apply_chat_template(CONVERSATION, generation_prompt)
        got = theirs.apply_chat_template(
            CONVERSATION, add_generation_prompt=generation_prompt, tokenize=False
        )
        assert got == want == folder.apply_chat_template(CONVERSATION, generation_prompt)


@pytest.mark.parametrize("kind", VOCABS)
def test_generation_config_has_the_files_bos_and_end_tokens(
    tiny_files: dict[str, Path], exported: dict[str, Path], kind: str
) -> None:
    reader = gguf.GGUFReader(tiny_files[kind])
    eos = reader.fields["tokenizer.ggml.eos_token_id"].contents()
    bos = reader.fields["tokenizer.ggml.bos_token_id"].contents()
    generation = json.loads((exported[kind] / "generation_config.json").read_text())
    assert generation["bos_token_id"] == bos
    assert generation["eos_token_id"] == ([eos, EOT_ID] if kind == "spm" else eos)
    ours = open_checkpoint(tiny_files[kind]).tokenizer()
    folder = Tokenizer.from_dir(exported[kind])
    assert folder.eos_token_ids == ours.eos_token_ids and folder.bos_token_id == bos


def test_a_second_call_reuses_the_cache(
    tiny_files: dict[str, Path], exported: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*_: object) -> None:
        raise AssertionError("exported again")

    monkeypatch.setattr(hf_export, "export_gguf", refuse)
    before = {p: p.stat().st_mtime_ns for p in exported["bpe"].iterdir()}
    assert hf_folder_for(tiny_files["bpe"]) == exported["bpe"]
    assert {p: p.stat().st_mtime_ns for p in exported["bpe"].iterdir()} == before


def test_a_changed_file_gets_a_new_folder(
    cache: Path, tiny_files: dict[str, Path], tmp_path: Path
) -> None:
    copy = tmp_path / tiny_files["bpe"].name
    shutil.copy2(tiny_files["bpe"], copy)
    first = export_folder(copy)
    assert first != export_folder(tiny_files["bpe"])  # another file, another folder
    assert export_folder(copy) == first  # stable
    stat = copy.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert export_folder(copy) != first
    with copy.open("ab") as f:
        f.write(b"\0")
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert export_folder(copy) != first  # the size counts too


def test_a_folder_passes_through(cache: Path, tmp_path: Path) -> None:
    folder = tmp_path / "some-hf-model"
    folder.mkdir()
    before = sorted(cache.iterdir()) if cache.exists() else []
    assert hf_folder_for(folder) == folder
    assert (sorted(cache.iterdir()) if cache.exists() else []) == before


def test_not_a_model(cache: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such file or folder"):
        hf_folder_for(tmp_path / "missing.gguf")
    text = tmp_path / "notes.txt"
    text.write_text("not a model")
    with pytest.raises(ModelLoadError, match="neither a Hugging Face model folder nor a GGUF"):
        hf_folder_for(text)


def _variant(folder: Path, out: Path, edit: Callable[[GgufContents], object]) -> Path:
    """The `bpe` file's contents with `edit` applied, written to `out`/variant.gguf."""
    contents = gguf_contents(folder, QT.Q4_0, vocab=bpe_vocab(folder))
    edit(contents)
    return write_contents(contents, out / "variant.gguf")


def test_refuses_an_architecture_transformers_cannot_convert(
    cache: Path, bpe_folder: Path, tmp_path: Path
) -> None:
    path = _variant(bpe_folder, tmp_path, lambda c: c.rename_arch("nonesuch"))
    with pytest.raises(ExportError) as info:
        hf_folder_for(path)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert str(path) in message and "'general.architecture'" in message and "nonesuch" in message
    assert not export_folder(path).exists()
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no staging left


def test_refuses_a_tensor_type_gguf_cannot_dequantize(
    cache: Path, bpe_folder: Path, tmp_path: Path
) -> None:
    name = "blk.1.ffn_down.weight"

    def q8_1(contents: GgufContents) -> None:
        data, _ = contents.tensors[name]
        rows = data.shape[0]
        row_len = contents.kv["llama.feed_forward_length"][0]
        block, size = gguf.GGML_QUANT_SIZES[QT.Q8_1]
        contents.tensors[name] = (np.zeros((rows, row_len // block * size), np.uint8), QT.Q8_1)

    path = _variant(bpe_folder, tmp_path, q8_1)
    with pytest.raises(ExportError) as info:
        hf_folder_for(path)
    message = str(info.value)
    assert str(path) in message and name in message and "Q8_1" in message


def test_refuses_a_file_without_a_vocabulary(cache: Path, bpe_folder: Path, tmp_path: Path) -> None:
    path = _variant(bpe_folder, tmp_path, lambda c: c.kv.pop("tokenizer.ggml.tokens"))
    with pytest.raises(ExportError, match=r"'tokenizer\.ggml\.tokens' is missing") as info:
        hf_folder_for(path)
    assert str(path) in str(info.value)


def test_without_transformers_the_error_says_what_to_install(
    tiny_files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(ModelLoadError, match=r"pip install 'zerohop\[vllm\]'"):
        hf_export.export_gguf(tiny_files["bpe"], tmp_path)

    def not_installed(name: str) -> str:
        raise hf_export.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(hf_export.importlib.metadata, "version", not_installed)
    with pytest.raises(ModelLoadError, match=r"pip install 'zerohop\[vllm\]'"):
        hf_folder_for(tiny_files["bpe"])


@pytest.mark.slow
def test_the_default_model_exports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2 (Q4_1): its export reads back as the file in zerohop, weights to the bit."""
    from transformers import AutoTokenizer

    from zerohop.models import resolve_model

    path = resolve_model(None)  # fetched once into the real cache
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = hf_folder_for(path)
    checkpoint = open_checkpoint(path)
    ours, theirs = checkpoint.tokenizer(), AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        assert theirs(text)["input_ids"] == ours.encode(text), text
    for generation_prompt in (True, False):
        want = ours.apply_chat_template(CONVERSATION, generation_prompt)
        got = theirs.apply_chat_template(
            CONVERSATION, add_generation_prompt=generation_prompt, tokenize=False
        )
        assert got == want
    saved = load_file(str(folder / "model.safetensors"))
    weights = checkpoint.weights()
    assert set(saved) == set(weights)
    for name, tensor in saved.items():
        want_tensor = weights[name]
        assert isinstance(want_tensor, torch.Tensor) and torch.equal(tensor, want_tensor.float())
    assert Tokenizer.from_dir(folder).eos_token_ids == ours.eos_token_ids
