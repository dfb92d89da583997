"""How long `zerohop serve` takes to start and to restart its engine (issue 40), quiet and
next to a busy neighbour.

For each of --rounds (2) rounds, quiet and then with a busy loop (`python -c "while True:
pass"`, no affinity) running beside it: start `zerohop serve` on the default model (default
flags, gateway off, a free port), time from spawn to /ready 200, read the engine's start
phases from its log ("engine start: PHASE in S s"), then SIGKILL the engine process and time
from the kill to /ready 200 again (the supervisor's restart: a fresh engine process, weights
from the page cache), with that restart's phases; then stop the server.

    .venv/bin/python benchmarks/start_times.py [--rounds 2]

Prints a table and writes bench-results/start_times.json (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from serve import free_port

ROOT = Path(__file__).resolve().parent.parent
PHASE = re.compile(r"engine start: (.+) in ([0-9.]+) s")


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/ready", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_ready(url: str, process: subprocess.Popen, limit: float = 900.0) -> float:
    started = time.monotonic()
    while not ready(url):
        if process.poll() is not None:
            raise SystemExit(f"the server exited ({process.returncode})")
        if time.monotonic() - started > limit:
            raise SystemExit("the server was not ready in time")
        time.sleep(0.05)
    return time.monotonic() - started


def engine_pid(server_pid: int) -> int:
    tasks = Path(f"/proc/{server_pid}/task").glob("*/children")
    (pid,) = [int(child) for task in tasks for child in task.read_text().split()]
    return pid


def phases(log: str) -> list[dict[str, Any]]:
    return [{"phase": m[1], "seconds": float(m[2])} for m in PHASE.finditer(log)]


def one_round(log_path: Path) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "zerohop", "serve", "--port", str(port), "--grpc-port", "0"]
    with log_path.open("w") as log:
        spawned = time.monotonic()
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        start = wait_ready(url, process)
        first = phases(log_path.read_text())
        killed = time.monotonic()
        os.kill(engine_pid(process.pid), signal.SIGKILL)
        while ready(url):  # until the server notices
            time.sleep(0.01)
        wait_ready(url, process)
        restart = time.monotonic() - killed
        second = phases(log_path.read_text())[len(first) :]
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    return {"start_s": round(start, 2), "spawned_s": round(time.monotonic() - spawned, 2),
            "start_phases": first, "restart_s": round(restart, 2),
            "restart_phases": second}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "start_times.json")
    args = p.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for noisy in (False, True):
            busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if noisy else None
            try:
                log = args.out.parent / f"start_times-{r + 1}-{'noisy' if noisy else 'quiet'}.log"
                result = {"round": r + 1, "neighbour": "busy" if noisy else "quiet",
                          **one_round(log)}  # fmt: skip
            finally:
                if busy is not None:
                    busy.kill()
                    busy.wait()
            results.append(result)
            steps = ", ".join(f"{x['phase']} {x['seconds']:.2f}" for x in result["start_phases"])
            again = ", ".join(f"{x['phase']} {x['seconds']:.2f}" for x in result["restart_phases"])
            print(f"round {r + 1} {result['neighbour']:5}: start {result['start_s']} s ({steps});"
                  f" restart {result['restart_s']} s ({again})")  # fmt: skip
    args.out.write_text(json.dumps({"runs": results, "cpus": os.cpu_count()}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
