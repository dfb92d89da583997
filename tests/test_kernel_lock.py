"""The CPU kernels' build lock: a `lock` file that a build killed mid-way left in the cache
directory no longer makes every later load wait forever (it is removed), while a build that
is still running (its owner holds build.lock) is waited for, its `lock` left alone.

Each load runs in a fresh interpreter (kernels.load is cached per process) on a temporary
XDG_CACHE_HOME, seeded with this machine's finished build when there is one so nothing is
compiled again."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zerohop.engine import kernels

ROOT = Path(__file__).resolve().parent.parent
LOAD = "from zerohop.engine.kernels import load; load(); print('loaded')"
BUILD_SECONDS = 600  # an upper bound for a build from scratch on a busy 2-core machine


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An XDG_CACHE_HOME whose kernel directory holds a finished build (copied, or built by
    the first load), without any lock file."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: the kernels cannot be built")
    home = tmp_path_factory.mktemp("cache")
    built = kernels.cache_dir()
    target = home / "zerohop" / "kernels" / built.name
    if any(built.glob("*.so")):
        shutil.copytree(built, target, ignore=shutil.ignore_patterns("lock", "build.lock"))
    else:
        target.mkdir(parents=True)
    return home


def _loader(cache_home: Path) -> subprocess.Popen:
    env = {**os.environ, "XDG_CACHE_HOME": str(cache_home), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", LOAD],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(process: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """The loader's output once it exits; a loader still waiting then is ended (SIGTERM)
    and the test fails, as a server start would have hung."""
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.terminate()
        out, err = process.communicate()
        pytest.fail(f"the kernel load still waited after {timeout} s: {err[-2000:]}")
    assert process.returncode == 0, err[-2000:]
    return out, err


def _build_dir(cache_home: Path) -> Path:
    return cache_home / "zerohop" / "kernels" / kernels.cache_dir().name


def test_a_stale_lock_is_removed_and_the_load_completes(cache_home: Path) -> None:
    stale = _build_dir(cache_home) / "lock"
    stale.touch()  # what torch's FileBaton leaves when its process is killed
    out, err = _finish(_loader(cache_home), BUILD_SECONDS)
    assert "loaded" in out
    assert "left by a kernel build that did not finish" in err
    assert not stale.exists()


def test_a_live_build_is_waited_for(cache_home: Path) -> None:
    build_dir = _build_dir(cache_home)
    lock = build_dir / "lock"
    with (build_dir / "build.lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # a builder that is alive: it holds build.lock
        lock.touch()
        process = _loader(cache_home)
        try:
            time.sleep(3)  # long enough to reach the lock; a fast loader would fail below
            assert process.poll() is None, "the load did not wait for the running build"
            assert lock.exists(), "a live build's lock file was removed"
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)  # the builder dies, leaving its lock file
    out, err = _finish(process, BUILD_SECONDS)
    assert "loaded" in out and "did not finish" in err and not lock.exists()
