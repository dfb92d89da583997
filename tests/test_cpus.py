"""The engine's default thread count fits the CPUs the process may use (issue 22, task 1).

zerohop.engine.cpus reads real files: cgroup trees (v2 `cpu.max`, v1 `cpu.cfs_quota_us` /
`cpu.cfs_period_us`) and a /proc/self/cgroup written under a temporary folder, as a container
on a many-core node would show them. The affinity mask is set for real, with `taskset` and
with os.sched_setaffinity in a subprocess, and `default_engine_threads` (cli/engine_flags.py)
is seen to follow it and log where its count came from.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zerohop.engine.cpus import cgroup_quota, usable_cpus

ROOT = Path(__file__).resolve().parent.parent
SHOW_DEFAULT = (
    "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stderr);"
    " from zerohop.cli import default_engine_threads; print(default_engine_threads())"
)


def cgroup_tree(tmp_path: Path, proc: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A /proc/self/cgroup holding `proc` and a cgroup mount holding `files` (path: text)."""
    root = tmp_path / "sys-fs-cgroup"
    root.mkdir()
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    proc_cgroup = tmp_path / "proc-self-cgroup"
    proc_cgroup.write_text(proc)
    return proc_cgroup, root


def test_a_v2_quota_of_one_and_a_half_cpus_gives_two_threads_on_a_64_cpu_node(
    tmp_path: Path,
) -> None:
    proc, root = cgroup_tree(
        tmp_path, "0::/kubepods/pod1/ctr\n", {"kubepods/pod1/ctr/cpu.max": "150000 100000\n"}
    )
    cpus = usable_cpus(64, proc, root)
    assert cpus.count == 2
    assert "cgroup CPU quota 1.5" in cpus.source and "cpu.max" in cpus.source


def test_an_unlimited_v2_cgroup_keeps_the_affinity_count(tmp_path: Path) -> None:
    proc, root = cgroup_tree(tmp_path, "0::/ctr\n", {"ctr/cpu.max": "max 100000\n"})
    assert cgroup_quota(proc, root) is None
    cpus = usable_cpus(6, proc, root)
    assert (cpus.count, cpus.source) == (6, "CPU affinity 6, no cgroup CPU quota")


def test_the_smallest_quota_above_the_process_wins(tmp_path: Path) -> None:
    proc, root = cgroup_tree(
        tmp_path,
        "0::/kubepods/pod1/ctr\n",
        {
            "kubepods/cpu.max": "800000 100000",
            "kubepods/pod1/cpu.max": "300000 100000",
            "kubepods/pod1/ctr/cpu.max": "max 100000",
        },
    )
    assert usable_cpus(64, proc, root).count == 3


def test_a_container_sees_its_own_cgroup_at_the_mount_root(tmp_path: Path) -> None:
    # /proc/self/cgroup names the host's path; the container's mount has only its own cgroup.
    proc, root = cgroup_tree(
        tmp_path, "0::/system.slice/docker-abc.scope\n", {"cpu.max": "200000 100000"}
    )
    assert usable_cpus(64, proc, root).count == 2


def test_a_quota_above_the_affinity_mask_is_capped_by_it(tmp_path: Path) -> None:
    proc, root = cgroup_tree(tmp_path, "0::/\n", {"cpu.max": "800000 100000"})
    cpus = usable_cpus(2, proc, root)
    assert cpus.count == 2 and cpus.source.startswith("CPU affinity 2, under the cgroup")


def test_cgroup_v1_quota_and_period(tmp_path: Path) -> None:
    proc, root = cgroup_tree(
        tmp_path,
        "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n",
        {
            "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "50000\n",
            "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
        },
    )
    cpus = usable_cpus(64, proc, root)
    assert cpus.count == 1  # half a CPU rounds up to one thread, never to none
    assert "cgroup CPU quota 0.5" in cpus.source and "cpu.cfs_quota_us" in cpus.source


def test_cgroup_v1_unlimited(tmp_path: Path) -> None:
    proc, root = cgroup_tree(
        tmp_path,
        "2:cpuacct,cpu:/\n",
        {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"},
    )
    assert usable_cpus(4, proc, root).count == 4


@pytest.mark.parametrize("text", ["", "garbage", "0::/ctr", "1:cpu:"])
def test_unreadable_or_odd_cgroups_keep_the_affinity_count(tmp_path: Path, text: str) -> None:
    proc, root = cgroup_tree(tmp_path, text, {"ctr/cpu.max": "abc 100000", "cpu.max": "1 0"})
    assert usable_cpus(3, proc, root).count == 3
    assert usable_cpus(3, tmp_path / "no-such-file", root).count == 3


def one_cpu() -> int:
    return min(os.sched_getaffinity(0))


def run_python(code: str, prefix: list[str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*(prefix or []), sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=True,
    )


@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset (util-linux)")
def test_the_default_thread_count_follows_taskset() -> None:
    done = run_python(SHOW_DEFAULT, ["taskset", "-c", str(one_cpu())])
    assert done.stdout.strip() == "1"
    assert "engine threads: 1 (CPU affinity 1" in done.stderr


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs affinity masks")
def test_the_default_thread_count_follows_sched_setaffinity() -> None:
    code = f"import os; os.sched_setaffinity(0, {{{one_cpu()}}}); {SHOW_DEFAULT}"
    done = run_python(code)
    assert done.stdout.strip() == "1"
    unmasked = run_python(SHOW_DEFAULT)
    assert unmasked.stdout.strip() == str(usable_cpus().count)
