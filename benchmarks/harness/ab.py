"""A/B against a git ref: the ref checked out into a detached worktree (its C++ kernels built
once, cached by a key that includes the path), and rounds that alternate the trees, so that a
machine drifting during the run moves both sides alike.

A `Tree` is where `zerohop serve` runs from: this checkout, or the ref's worktree, whose
`python -m zerohop` imports the tree's own code (PYTHONPATH, ahead of the venv's editable
install of this checkout).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from _common import ROOT


def git(*args: str, check: bool = True) -> str:
    """What `git -C ROOT ARGS` prints, stripped; with `check` False, "" when it fails."""
    done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    if done.returncode and check:
        raise SystemExit(f"git {shlex.join(args)} failed: {done.stderr.strip()}")
    return "" if done.returncode else done.stdout.strip()


def resolve(ref: str) -> str:
    """The full hash of the commit `ref` names (HEAD~1, a branch, a hash)."""
    found = git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", check=False)
    if not found:
        raise SystemExit(f"--baseline: {ref!r} names no commit of {ROOT}")
    return found


@dataclass(slots=True, frozen=True)
class Tree:
    """A checkout that `zerohop serve` runs from; `commit` (short) for a baseline."""

    path: Path
    commit: str | None = None

    @property
    def name(self) -> str:
        return f"baseline@{self.commit}" if self.commit else "current"

    def env(self, **extra: str) -> dict[str, str]:
        return os.environ | {"PYTHONPATH": str(self.path)} | extra


CURRENT = Tree(ROOT)


def prepare(tree: Tree) -> None:
    """Check that the tree's `python -m zerohop` imports its own code, and build (or find)
    its kernels, so that no server start builds them."""
    where = subprocess.run(
        [sys.executable, "-c", "import zerohop; print(zerohop.__file__)"],
        cwd=tree.path, env=tree.env(), check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    if not Path(where).resolve().is_relative_to(tree.path.resolve()):
        raise SystemExit(f"{tree.path}: Python imports zerohop from {where}, not from the tree")
    kernels = [sys.executable, "-m", "zerohop.engine.kernels"]
    subprocess.run(kernels, cwd=tree.path, env=tree.env(), check=True, capture_output=True)


@contextlib.contextmanager
def worktree(ref: str) -> Iterator[Tree]:
    """`ref` checked out in a detached worktree, prepared, for the duration; removed after,
    also on Ctrl-C or an error. The same path for the same commit finds its kernels built."""
    commit = resolve(ref)
    path = Path(tempfile.gettempdir()) / f"zerohop-baseline-{commit[:12]}"
    if path.exists():
        raise SystemExit(f"{path} exists: another run's, or left behind (git worktree remove)")
    try:
        git("worktree", "add", "--detach", str(path), commit)
        tree = Tree(path, git("rev-parse", "--short", commit))
        print(f"baseline {tree.commit} in {path}", flush=True)
        prepare(tree)
        yield tree
    finally:
        remove = ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)]
        subprocess.run(remove, capture_output=True)
        if path.exists():
            print(f"! the baseline's worktree is still there: {shlex.join(remove)}")


@contextlib.contextmanager
def trees(baseline: str | None) -> Iterator[list[Tree]]:
    """This checkout, and the baseline's worktree when a ref is given."""
    if baseline is None:
        yield [CURRENT]
        return
    with worktree(baseline) as base:
        yield [CURRENT, base]


def alternating(rounds: int, sides: Sequence[Tree]) -> Iterator[tuple[int, Tree]]:
    """(round, tree) in the order A B, B A, A B...: each side goes first every other round."""
    for r in range(rounds):
        for tree in sides if r % 2 == 0 else list(reversed(sides)):
            yield r, tree


def spread(values: Sequence[float]) -> dict[str, float | None]:
    """Median, lowest and highest of the rounds' values, and (max - min) / median."""
    if not values:
        return {"median": None, "min": None, "max": None, "spread": None}
    mid = statistics.median(values)
    return {
        "median": mid,
        "min": min(values),
        "max": max(values),
        "spread": (max(values) - min(values)) / mid if mid else None,
    }


def compare(current: Sequence[float], baseline: Sequence[float]) -> dict[str, object]:
    """Current over baseline per round (paired in order) and of the medians, each side's spread,
    and whether the medians differ by more than the larger spread."""
    ratios = [c / b for c, b in zip(current, baseline, strict=False) if b]
    a, b = spread(current), spread(baseline)
    ratio = a["median"] / b["median"] if a["median"] and b["median"] else None
    widest = max((s for s in (a["spread"], b["spread"]) if s is not None), default=None)
    beyond = None if ratio is None or widest is None else abs(ratio - 1) > widest
    return {
        "current": a,
        "baseline": b,
        "ratio": ratio,
        "per_round": ratios,
        "beyond_spread": beyond,
    }
