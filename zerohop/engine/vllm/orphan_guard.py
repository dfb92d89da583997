"""vLLM's EngineCore ends when the zerohop process above it is gone.

zerohop's own engine process ends when its socket to the API process closes. vLLM's EngineCore
talks over ZeroMQ, which does not notice a peer that was SIGKILLed (or OOM-killed), so its
process, and the GPU memory it holds, would outlive the server. zerohop's scheduler class runs
inside the EngineCore, so it starts this guard there: a daemon thread that sends the EngineCore
SIGTERM (vLLM's own clean shutdown, which ends its workers too) once its parent has changed.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

log = logging.getLogger(__name__)

CHECK_SECONDS = 1.0
_started = False


def guard_against_orphaning() -> None:
    """Start the guard in this process (once)."""
    global _started
    if _started:
        return
    _started = True
    parent = os.getppid()
    thread = threading.Thread(
        target=_watch, args=(parent,), name="zerohop-orphan-guard", daemon=True
    )
    thread.start()


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(CHECK_SECONDS)
    log.error("the zerohop process above vLLM's EngineCore is gone: shutting down")
    os.kill(os.getpid(), signal.SIGTERM)
