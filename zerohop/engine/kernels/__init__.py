"""zerohop's C++ CPU kernels, built with PyTorch's extension machinery and cached.

`make` builds them once at install time (`python -m zerohop.engine.kernels`); later loads
find the cached library in `~/.cache/zerohop/kernels/<key>` (ninja sees nothing to redo).
The key covers the source, the torch version and the CPU, so a changed machine or torch
rebuilds. Without a C++ compiler the engine falls back to float weights, and says why.

torch's loader marks a build in progress with a `lock` file it creates and removes itself;
a process killed mid-build leaves the file behind, and every later load would wait on it
forever. So each load holds an flock on a sibling `build.lock` (never removed) around
torch's: the kernel drops an flock when its holder dies, so whoever holds ours knows no
live zerohop is building there, and a `lock` file it finds is stale and safe to remove.

Imports nothing of zerohop.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import torch

SOURCE = Path(__file__).with_name("qgemm.cpp")
HEADERS = tuple(
    Path(__file__).with_name(name)
    for name in (
        "spin_pool.h",
        "attention.h",
        "pointwise.h",
        "vec_math.h",
        "decode_step.h",
        "dense_gemm.h",
        "bf16_gemm.h",
        "token_mask.h",
        "int16_rows.h",
        "panel_product.h",
        "kquant.h",
    )
)
log = logging.getLogger("zerohop.kernels")


class KernelsUnavailable(RuntimeError):
    pass


def cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "zerohop" / "kernels" / _build_key()


def _build_key() -> str:
    cpu = torch.backends.cpu.get_cpu_capability()
    sources = [SOURCE.read_bytes(), *(h.read_bytes() for h in HEADERS)]
    parts = [*sources, torch.__version__.encode(), cpu.encode(), _cpu_flags()]
    # The checkout's path too: torch's build.ninja names the sources by path, so two
    # checkouts sharing one folder would each rebuild the library the other just built.
    parts.append(str(SOURCE).encode())
    parts.append(" ".join(_compiler_flags()).encode())
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _cpu_flags() -> bytes:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.encode()
    except OSError:
        pass
    return platform.processor().encode()


def _compiler_flags() -> list[str]:
    # -march=native: the library is built and cached on the machine that runs it.
    return ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only"]


@cache
def load() -> ModuleType:
    """The compiled kernels module (building it if needed), or KernelsUnavailable."""
    if sys.platform == "win32":
        raise KernelsUnavailable("the CPU kernels are built for Linux and macOS only")
    from torch.utils.cpp_extension import load as load_extension

    _put_ninja_on_path()
    build_dir = cache_dir()
    build_dir.mkdir(parents=True, exist_ok=True)
    if not any(build_dir.glob("*.so")):
        log.warning("building zerohop's CPU kernels into %s (once, ~30 s)", build_dir)
    try:
        with build_lock(build_dir):
            # torch's loader returns the built module; torch is skipped by mypy (its types
            # are Any here), so the cast says what it is.
            return cast(
                ModuleType,
                load_extension(
                    name="zerohop_qgemm",
                    sources=[str(SOURCE)],
                    extra_cflags=_compiler_flags(),
                    build_directory=str(build_dir),
                    verbose=False,
                ),
            )
    except (OSError, RuntimeError, ImportError, SystemExit) as exc:
        raise KernelsUnavailable(f"building the CPU kernels failed: {exc}") from exc


@contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Hold `build_dir`'s build.lock (waiting while another process builds there), with
    any `lock` file a dead builder left removed."""
    import fcntl  # POSIX only; load() refuses Windows before this

    with (build_dir / "build.lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released on close, or when this process dies
        try:
            _remove_stale_lock(build_dir)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_stale_lock(build_dir: Path) -> None:
    """With build.lock held no live zerohop is inside torch's loader here, so its `lock`
    file, if there is one, belongs to a process that died mid-build."""
    stale = build_dir / "lock"
    if stale.exists():
        log.warning("removing %s, left by a kernel build that did not finish", stale)
        stale.unlink(missing_ok=True)


def cpu_kernel(name: str, device: torch.device, dtype: torch.dtype) -> Callable[..., Any] | None:
    """One of the kernels, for float32 on CPU when they are built; else None."""
    if device.type != "cpu" or dtype != torch.float32 or not available():
        return None
    kernel: Callable[..., Any] = getattr(load(), name)  # a function of the built module
    return kernel


@cache  # one build attempt, and one warning, per process
def available() -> bool:
    try:
        load()
    except KernelsUnavailable as exc:
        log.warning(
            "%s (a C++ compiler is needed: `c++`, or the one $CXX names); zerohop computes with"
            " float32 torch ops instead, quantized weights dequantized",
            exc,
        )
        return False
    return True


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the `ninja` wheel's binary may not be on it."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path])
