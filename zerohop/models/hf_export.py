"""A Hugging Face folder for a GGUF file, made once: what vLLM's engine loads.

vLLM reads Hugging Face folders (config.json, *.safetensors, tokenizer files,
generation_config.json); its own GGUF loader fetches the config from the hub. So `--engine
vllm` converts a GGUF file once with transformers' GGUF support (which dequantizes with the
`gguf` package) and caches the folder:

    cache_dir()/hf-export/<file stem>-<12 hex digits>/

The digits hash the file's resolved path, size and mtime, the installed transformers version
(its config.json and tokenizer files are what it, and so vLLM, reads back) and EXPORT_VERSION:
a changed file, a new transformers or a new export format gets a fresh folder. Folders are
built in a staging folder beside the target and renamed into place, so a cached folder is
always whole, and two processes exporting at once leave one copy.

The weights are saved in float32, dequantized exactly; a file whose matrices are all F16
(or all BF16) is saved in that type, its matrices exactly and its F32 vectors (norms, biases)
rounded to it, as vLLM would: its dtype "auto" keeps config.json's 16-bit dtype (and casts
float32 down to its platform's 16-bit type).
The tokenizer files carry the file's chat template (`tokenizer.chat_template`) in
tokenizer_config.json and its rule for adding BOS/EOS (`tokenizer.ggml.add_bos_token`, ...)
in tokenizer.json's post-processor; generation_config.json carries the file's BOS and its
end tokens (`eos`, then `eot` and `eom`).

transformers is not a dependency of zerohop, only of vLLM: it is imported here, when a file
is converted.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerohop.engine.base.errors import ModelLoadError
from zerohop.models.cache import cache_dir

log = logging.getLogger(__name__)

EXPORT_VERSION = 1
EXPORT_DIR = "hf-export"
INSTALL_HINT = "pip install 'zerohop[vllm]'"
_FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_EOS_KEYS = ("eos_token_id", "eot_token_id", "eom_token_id")


class ExportError(ModelLoadError, ValueError):
    """A GGUF file transformers cannot convert to a Hugging Face folder."""


def hf_folder_for(model: Path) -> Path:
    """The Hugging Face folder vLLM loads for `model`: a folder as it is; a GGUF file
    converted once (see the module's docstring) into a cached folder.

    Raises ModelLoadError when `model` is neither, or transformers is not installed, and
    ExportError (a ValueError too) naming the file and the field transformers cannot convert.
    """
    model = Path(model)
    if model.is_dir():
        return model
    if not model.exists():
        raise ModelLoadError(f"{model}: no such file or folder")
    if not _is_gguf(model):
        raise ModelLoadError(f"{model}: neither a Hugging Face model folder nor a GGUF file")
    target = export_folder(model)
    if _is_whole(target):
        return target
    log.info("converting %s to a Hugging Face folder for vLLM (once): %s", model, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        started = time.monotonic()
        export_gguf(model, staging)
        try:
            staging.rename(target)
        except OSError:  # another process exported it first
            if not _is_whole(target):
                raise
        log.debug("exported %s in %.1f s", model, time.monotonic() - started)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already when the rename succeeded
    return target


def export_folder(gguf_file: Path) -> Path:
    """Where the export of `gguf_file` is cached, whether or not it is there yet."""
    gguf_file = Path(gguf_file)
    path = gguf_file.resolve()
    stat = path.stat()
    key = "\0".join(
        str(part)
        for part in (EXPORT_VERSION, path, stat.st_size, stat.st_mtime_ns, _transformers_version())
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_dir() / EXPORT_DIR / f"{gguf_file.stem}-{digest}"


def export_gguf(gguf_file: Path, folder: Path) -> None:
    """Convert `gguf_file` with transformers into the Hugging Face folder `folder` (which
    exists and is empty). No cache: `hf_folder_for` is the way in."""
    gguf_file = Path(gguf_file)
    facts = read_facts(gguf_file)
    transformers = _import_transformers()
    import torch

    # The file alone in a folder: transformers also reads a tokenizer_config.json or a
    # config.json that lies next to a GGUF file.
    with tempfile.TemporaryDirectory(prefix="zerohop-gguf-") as source:
        link = Path(source) / gguf_file.with_suffix(".gguf").name
        link.symlink_to(gguf_file.resolve())
        model = _load_model(transformers, gguf_file, facts, link, getattr(torch, facts.dtype))
        tokenizer = _load_tokenizer(transformers, gguf_file, link)
    _save_model(model, gguf_file, facts, folder)
    _save_tokenizer(tokenizer, facts, folder)


@dataclass(frozen=True)
class GgufFacts:
    """What the export takes from the file's metadata itself."""

    architecture: str
    chat_template: str | None
    bos_token_id: int | None
    eos_token_ids: list[int]  # eos, then eot and eom where the file names them
    add_bos: bool  # whether encoding a text starts it with BOS
    add_eos: bool  # ... and ends it with EOS
    dtype: str  # torch's name: float32, float16 or bfloat16


def read_facts(gguf_file: Path) -> GgufFacts:
    """The file's metadata the export needs, refusing (ExportError) what it cannot convert:
    no vocabulary, or a tensor type the `gguf` package cannot dequantize."""
    import gguf
    import numpy as np

    try:
        reader = gguf.GGUFReader(gguf_file)
    except Exception as exc:  # the reader raises whatever numpy hits in a bad file
        raise ExportError(f"{gguf_file}: not a readable GGUF file ({exc})") from exc

    def field(key: str) -> Any:
        found = reader.fields.get(key)
        return None if found is None else found.contents()

    architecture = field("general.architecture")
    if not isinstance(architecture, str):
        raise ExportError(f"{gguf_file}: field 'general.architecture' is missing")
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens"):
        if field(key) is None:
            raise ExportError(
                f"{gguf_file}: field '{key}' is missing: the file carries no tokenizer to export"
            )
    matrix_types = set()
    for tensor in reader.tensors:
        kind = tensor.tensor_type
        if kind.name not in _FLOAT_TYPES and not _can_dequantize(gguf, np, kind):
            raise ExportError(
                f"{gguf_file}: tensor '{tensor.name}' has type {kind.name}, which the gguf"
                " package cannot dequantize"
            )
        if len(tensor.shape) >= 2:
            matrix_types.add(kind.name)
    dtype = "float32"
    if len(matrix_types) == 1 and (only := matrix_types.pop()) in _FLOAT_TYPES:
        dtype = _FLOAT_TYPES[only]
    eos = [field(f"tokenizer.ggml.{key}") for key in _EOS_KEYS]
    # llama.cpp's defaults: SentencePiece vocabularies add BOS unless the file says not.
    add_bos = field("tokenizer.ggml.add_bos_token")
    return GgufFacts(
        architecture=architecture,
        chat_template=field("tokenizer.chat_template"),
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(i for i in eos if i is not None)),
        add_bos=bool(field("tokenizer.ggml.model") == "llama" if add_bos is None else add_bos),
        add_eos=bool(field("tokenizer.ggml.add_eos_token")),
        dtype=dtype,
    )


def _can_dequantize(gguf: Any, np: Any, kind: Any) -> bool:
    """Whether `gguf.quants.dequantize` knows `kind` (tried on one block of zeros)."""
    try:
        _, type_size = gguf.GGML_QUANT_SIZES[kind]
        gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), kind)
    except (NotImplementedError, KeyError, ValueError):
        return False
    return True


def _load_model(
    transformers: Any, gguf_file: Path, facts: GgufFacts, link: Path, dtype: Any
) -> Any:
    options: dict[str, Any] = {"dtype": dtype}
    if hasattr(transformers, "GgufConfig"):  # transformers 5 may keep weights packed: unpack
        options["quantization_config"] = transformers.GgufConfig(dequantize=True)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            link.parent, gguf_file=link.name, **options
        )
    except (ValueError, NotImplementedError, KeyError) as exc:
        raise ExportError(
            f"{gguf_file}: transformers {_transformers_version()} cannot convert field"
            f" 'general.architecture' {facts.architecture!r} to a Hugging Face model"
            f" ({_first_line(exc)})"
        ) from exc
    for name, tensor in model.state_dict().items():
        if not tensor.is_floating_point():
            raise ExportError(
                f"{gguf_file}: transformers kept weight {name} packed ({tensor.dtype});"
                " it cannot be saved as a plain checkpoint"
            )
    # Dequantized, the model is a plain one: forget the GGUF "quantization" so it saves.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model


def _load_tokenizer(transformers: Any, gguf_file: Path, link: Path) -> Any:
    try:
        return transformers.AutoTokenizer.from_pretrained(link.parent, gguf_file=link.name)
    except (ValueError, NotImplementedError, KeyError) as exc:
        raise ExportError(
            f"{gguf_file}: transformers {_transformers_version()} cannot convert its tokenizer"
            f" (field 'tokenizer.ggml.model') ({_first_line(exc)})"
        ) from exc


def _save_model(model: Any, gguf_file: Path, facts: GgufFacts, folder: Path) -> None:
    generation = model.generation_config
    if facts.bos_token_id is not None:
        generation.bos_token_id = facts.bos_token_id
    if facts.eos_token_ids:
        ids = facts.eos_token_ids
        generation.eos_token_id = ids if len(ids) > 1 else ids[0]
    model.save_pretrained(folder, safe_serialization=True)
    if not any(folder.glob("*.safetensors")):
        raise ExportError(f"{gguf_file}: transformers saved no *.safetensors file")


def _save_tokenizer(tokenizer: Any, facts: GgufFacts, folder: Path) -> None:
    """The tokenizer files, with the file's chat template in tokenizer_config.json (the one
    place every transformers version reads it from), and the file's BOS/EOS rule in
    tokenizer.json's post-processor (transformers 5 drops `tokenizer.ggml.add_bos_token`)."""
    tokenizer.save_pretrained(folder)
    _add_special_tokens_as_the_file_does(folder / "tokenizer.json", facts)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["add_bos_token"], config["add_eos_token"] = facts.add_bos, facts.add_eos
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config.pop("chat_template", None)
    if facts.chat_template is not None:
        config["chat_template"] = facts.chat_template
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")


def _add_special_tokens_as_the_file_does(tokenizer_json: Path, facts: GgufFacts) -> None:
    """tokenizer.json's post-processor: BOS before a text and EOS after it where the file
    says so, as transformers' own `update_post_processor` writes it."""
    from tokenizers import Tokenizer, processors

    backend = Tokenizer.from_file(str(tokenizer_json))
    eos_id = facts.eos_token_ids[0] if facts.eos_token_ids else None
    bos = backend.id_to_token(facts.bos_token_id) if facts.bos_token_id is not None else None
    eos = backend.id_to_token(eos_id) if eos_id is not None else None
    special: list[tuple[str, int]] = []
    before: list[str] = []
    after: list[str] = []
    if facts.add_bos and bos is not None and facts.bos_token_id is not None:
        special.append((bos, facts.bos_token_id))
        before.append(bos)
    if facts.add_eos and eos is not None and eos_id is not None:
        special.append((eos, eos_id))
        after.append(eos)

    def sequence(piece: str, type_id: int) -> list[str]:
        return [f"{t}:{type_id}" for t in before] + [piece] + [f"{t}:{type_id}" for t in after]

    backend.post_processor = processors.TemplateProcessing(
        single=sequence("$A:0", 0),
        pair=sequence("$A:0", 0) + sequence("$B:1", 1),
        special_tokens=special,
    )
    backend.save(str(tokenizer_json))


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ModelLoadError(
            f"the vLLM engine converts GGUF files with transformers, which is not installed"
            f" ({exc}): {INSTALL_HINT}"
        ) from exc
    return transformers


def _transformers_version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelLoadError(
            f"the vLLM engine converts GGUF files with transformers, which is not installed:"
            f" {INSTALL_HINT}"
        ) from exc


def _first_line(exc: BaseException) -> str:
    return next(iter(str(exc).splitlines()), type(exc).__name__)


def _is_gguf(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def _is_whole(folder: Path) -> bool:
    return (folder / "config.json").is_file()
