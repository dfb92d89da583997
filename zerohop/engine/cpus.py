"""How many CPUs this process may really use: its affinity mask, capped by its cgroup's quota.

`os.cpu_count()` is the node's count: in a container limited to 2 CPUs on a 64-core node it
says 64, and an engine sized by it starts 64 threads that fight over 2 CPUs' worth of time
(each parallel region then waits for threads the quota has descheduled). What the process
may run on is its affinity mask (`taskset`, a cpuset), and how much of that it may use is
its CPU bandwidth quota (Kubernetes `resources.limits.cpu`, `docker --cpus`):
cgroup v2 `cpu.max` ("QUOTA PERIOD", or "max PERIOD" when unlimited), or cgroup v1
`cpu.cfs_quota_us` / `cpu.cfs_period_us` (-1 when unlimited), of the process's own cgroup
(read from /proc/self/cgroup) or any cgroup above it, the smallest winning. A fractional
quota is rounded up (1.5 CPUs: 2 threads, the second one busy part of the time).

Torch-free and path-driven, so tests run it on files they write.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CPU_FOLDERS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")


@dataclass(slots=True, frozen=True)
class CpuCount:
    """A thread count and, for the start-up log, where it came from."""

    count: int
    source: str


@dataclass(slots=True, frozen=True)
class Quota:
    cpus: float  # quota / period
    source: str  # the file it was read from


def affinity_count() -> int:
    """CPUs in this process's affinity mask (all of them where the OS has no masks)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def usable_cpus(
    affinity: int | None = None,
    proc_cgroup: Path = PROC_CGROUP,
    cgroup_root: Path = CGROUP_ROOT,
) -> CpuCount:
    """The affinity count, lowered to the cgroup quota rounded up (at least 1)."""
    mask = affinity if affinity is not None else affinity_count()
    quota = cgroup_quota(proc_cgroup, cgroup_root)
    affinity_text = f"CPU affinity {mask}"
    if quota is None:
        return CpuCount(mask, f"{affinity_text}, no cgroup CPU quota")
    quota_text = f"cgroup CPU quota {quota.cpus:g} ({quota.source})"
    if math.ceil(quota.cpus) >= mask:
        return CpuCount(mask, f"{affinity_text}, under the {quota_text}")
    return CpuCount(max(1, math.ceil(quota.cpus)), f"{quota_text}, under the {affinity_text}")


def cgroup_quota(proc_cgroup: Path = PROC_CGROUP, cgroup_root: Path = CGROUP_ROOT) -> Quota | None:
    """The smallest CPU quota on the way from this process's cgroup to the root; None when
    unlimited or unreadable (no cgroups, another OS)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    v2, v1 = _cgroup_paths(lines)
    quotas = []
    if v2 is not None:
        quotas += _walk(cgroup_root, v2, _read_v2)
    if v1 is not None:
        for folder in V1_CPU_FOLDERS:
            if (cgroup_root / folder).is_dir():
                quotas += _walk(cgroup_root / folder, v1, _read_v1)
                break
    return min(quotas, key=lambda q: q.cpus, default=None)


def _cgroup_paths(lines: list[str]) -> tuple[str | None, str | None]:
    """The v2 path ("0::/path") and the v1 path of the `cpu` controller ("N:cpu,...:/path")."""
    v2 = v1 = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    return v2, v1


def _walk(mount: Path, path: str, read: Callable[[Path], Quota | None]) -> list[Quota]:
    """Quotas of the cgroup at `path` under `mount` and of those above it. Inside a container
    the path may name the host's view, which the container's mount does not have: then the
    mount's own root is the container's cgroup."""
    folder = mount / path.strip("/")
    if not folder.is_dir():
        folder = mount
    quotas = []
    while True:
        if (quota := read(folder)) is not None:
            quotas.append(quota)
        if folder == mount or mount not in folder.parents:
            return quotas
        folder = folder.parent


def _read_v2(folder: Path) -> Quota | None:
    path = folder / "cpu.max"
    fields = _read(path).split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    return _quota(fields[0], fields[1], path)


def _read_v1(folder: Path) -> Quota | None:
    quota_path = folder / "cpu.cfs_quota_us"
    return _quota(_read(quota_path), _read(folder / "cpu.cfs_period_us"), quota_path)


def _quota(quota: str, period: str, source: Path) -> Quota | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    if q <= 0 or p <= 0:  # -1: unlimited (v1)
        return None
    return Quota(q / p, str(source))


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""
