"""Reading *.safetensors shards memory-mapped, without an extra copy of the weights.

The format is an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and byte range, then the raw bytes. Each tensor we return is a view into a
private (copy-on-write) mapping of the file, so loading costs page-cache reads only.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from zerohop.engine.base.errors import ModelLoadError

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def shard_paths(model_dir: Path) -> list[Path]:
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"{model_dir}: no *.safetensors file found (model weights)")
    return shards


def iter_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of one shard, as views into a mapping."""
    with path.open("rb") as f:
        try:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        except (struct.error, ValueError) as exc:
            raise ModelLoadError(f"{path}: not a valid safetensors file ({exc})") from exc
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    data_start = 8 + header_len
    for name, info in header.items():
        if name == "__metadata__":
            continue
        yield name, _view(mapping, data_start, info, path, name)


def _view(
    mapping: mmap.mmap, data_start: int, info: dict[str, Any], path: Path, name: str
) -> torch.Tensor:
    dtype = _DTYPES.get(info.get("dtype", ""))
    if dtype is None:
        raise ModelLoadError(f"{path}: tensor '{name}' has unsupported dtype {info.get('dtype')}")
    begin, end = info["data_offsets"]
    shape = info["shape"]
    count = (end - begin) // dtype.itemsize
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(mapping, dtype=dtype, count=count, offset=data_start + begin)
    return flat.view(shape)


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in shard_paths(model_dir):
        tensors.update(iter_tensors(path))
    return tensors
