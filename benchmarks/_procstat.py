"""CPU and memory of processes and of the machine, for the benchmarks (psutil).

Process CPU is user + system time of the process and all its threads (not of its children:
a layer made of several processes lists them, `tree` finds them). The kernel counts it in
clock ticks (10 ms), so tiny runs read 0. The machine's busy time is every CPU's time but
idle and iowait (another job on a shared machine shows there).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path

import psutil

_GONE = (psutil.NoSuchProcess, psutil.AccessDenied)


def process_cpu_s(pid: int) -> float:
    """CPU seconds of one process (all its threads) so far; it must exist."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def cpu_seconds(pids: Iterable[int]) -> float:
    """CPU seconds of `pids` summed; a process that is gone counts nothing."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(*_GONE):
            total += process_cpu_s(pid)
    return total


def machine_busy_s() -> float:
    """Busy seconds of all CPUs since boot (all but idle and iowait)."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + t.steal


def children(pid: int, marker: str | None = None) -> list[int]:
    """The direct children of `pid` (of any of its threads), oldest first; with `marker`,
    those whose command line contains it."""
    found = []
    for child in sorted(psutil.Process(pid).children(), key=_started):
        with contextlib.suppress(*_GONE):
            if marker is None or marker in " ".join(child.cmdline()):
                found.append(child.pid)
    return found


def tree(pid: int) -> list[int]:
    """`pid` and all its descendants."""
    with contextlib.suppress(*_GONE):
        return [pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))]
    return [pid]


def memory_mib(pids: Iterable[int]) -> dict[str, float]:
    """Resident memory now and at its peak, summed over `pids`, in MiB. The peak is the
    kernel's VmHWM (/proc/PID/status), which psutil does not report."""
    rss = hwm = 0
    for pid in pids:
        with contextlib.suppress(*_GONE, OSError):
            now, peak = psutil.Process(pid).memory_info().rss, _peak_rss(pid)
            rss, hwm = rss + now, hwm + peak
    return {"rss_mib": rss / 2**20, "peak_rss_mib": hwm / 2**20}


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # kB
    return 0


def _started(process: psutil.Process) -> float:
    try:
        return process.create_time()
    except _GONE:
        return 0.0
