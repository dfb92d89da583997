"""Supervision of the engine process: when it dies, start a new one; when that keeps
failing, give up so the orchestrator restarts the whole server.

`EngineSupervisor` is the engine the server holds: `AsyncEngine`'s calls (generate, abort,
stats, info, latest_stats, queued), served by the engine process of the moment. When that
process dies (kill -9, the OOM killer, a fatal error), its in-flight requests fail with
`EngineDeadError` and a new process is started at once (the weights come from the page
cache). A start that is not ready within the policy's `start_timeout` is killed and counted as
a failed start. While it starts, `dead` says why nothing is served (the server answers 529/503 with
`retry_after()`, and /ready is 503) but `gave_up` is None: the process is alive and
recovering, so /health stays 200. A start that fails is retried after a back-off.

More than `max_restarts` restarts within `window` seconds, or `max_restarts` failed starts
in a row, is a crash loop a new engine process will not end: the supervisor gives up,
`gave_up` says why, and `on_give_up` is called (the server then fails /health and exits
non-zero). `restarts` counts every start after the first (`zerohop_engine_restarts_total`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Unpack

from zerohop.engine.base.options import EngineOptions
from zerohop.engine.base.outputs import EngineInfo, EngineStatsDict, RequestDelta
from zerohop.engine.client import (
    DEFAULT_OPTIONS,
    EngineLife,
    EngineStarter,
    Queued,
    RequestOptions,
)
from zerohop.engine.process.async_engine import DEFAULT_START_TIMEOUT, AsyncEngine
from zerohop.engine.sample.sampling_params import SamplingParams

log = logging.getLogger(__name__)

DEFAULT_MAX_RESTARTS = 3
DEFAULT_RESTART_WINDOW = 300.0  # seconds
BACKOFF_SECONDS = (1.0, 2.0, 4.0, 8.0)  # after the 1st, 2nd, 3rd... failed start in a row


@dataclass(slots=True, frozen=True)
class RestartPolicy:
    max_restarts: int = DEFAULT_MAX_RESTARTS  # within `window`; 0: the first death gives up
    window: float = DEFAULT_RESTART_WINDOW  # seconds
    start_timeout: float = DEFAULT_START_TIMEOUT  # seconds a start may take; past it, failed

    def __post_init__(self) -> None:
        if not self.start_timeout > 0:
            raise ValueError(f"the start timeout must be > 0 seconds, not {self.start_timeout}")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int):
            raise ValueError("max_restarts must be a whole number")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, not {self.max_restarts}")
        if not self.window > 0:
            raise ValueError(f"the restart window must be > 0 seconds, not {self.window}")


class EngineSupervisor:
    def __init__(
        self,
        engine: EngineLife,
        model_path: str,
        engine_options: EngineOptions,
        policy: RestartPolicy,
        start_seconds: float,
        starter: EngineStarter = AsyncEngine.start,
    ) -> None:
        self.engine = engine  # the engine of the moment (a dead one while restarting)
        self.model_path, self.engine_options, self.policy = model_path, engine_options, policy
        self.starter = starter
        self.restarts = 0
        self.gave_up: str | None = None
        self.on_give_up: Callable[[str], None] | None = None
        self._start_seconds = start_seconds  # how long the latest successful start took
        self._down_since: float | None = None
        self._attempts: deque[float] = deque()  # when each restart began, within the window
        self._closing = False
        self._watcher = asyncio.create_task(self._watch())

    @classmethod
    async def start(
        cls,
        model_path: str,
        policy: RestartPolicy | None = None,
        starter: EngineStarter = AsyncEngine.start,
        **engine_options: Unpack[EngineOptions],
    ) -> EngineSupervisor:
        """Start the first engine life with `starter` (zerohop's engine process by default,
        `zerohop.engine.vllm.engine.VllmEngine.start` for vLLM's); its failure is raised
        (nothing to supervise)."""
        policy = policy or RestartPolicy()
        started = time.monotonic()
        engine = await starter(model_path, policy.start_timeout, **engine_options)
        elapsed = time.monotonic() - started
        log.info("engine started in %.1f s", elapsed)
        return cls(engine, model_path, engine_options, policy, elapsed, starter)

    # -- what the server reads ------------------------------------------------------------

    @property
    def dead(self) -> str | None:
        """Why no request can be served now (restarting, or given up); None when serving."""
        return self.gave_up or self.engine.dead

    @property
    def info(self) -> EngineInfo:
        return self.engine.info

    @property
    def latest_stats(self) -> EngineStatsDict | None:
        return self.engine.latest_stats

    @property
    def queued(self) -> dict[str, Queued]:
        return self.engine.queued

    @property
    def pid(self) -> int | None:
        return self.engine.pid

    def retry_after(self) -> float:
        """Seconds until a restarting engine should serve: its latest start's duration less
        the time it has been down, at least 1."""
        if self._down_since is None:
            return 1.0
        return max(1.0, self._start_seconds - (time.monotonic() - self._down_since))

    # -- AsyncEngine's calls, on the engine of the moment -----------------------------------

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        announce: bool = False,
        options: RequestOptions = DEFAULT_OPTIONS,
    ) -> AsyncGenerator[RequestDelta, None]:
        return self.engine.generate(request_id, prompt_token_ids, params, announce, options)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def call(self, name: str) -> EngineStatsDict | None:
        return await self.engine.call(name)

    async def stats(self) -> EngineStatsDict:
        return await self.engine.stats()

    async def shutdown(self, timeout: float = 10.0) -> None:
        self._closing = True
        self._watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._watcher
        await self.engine.shutdown(timeout)

    # -- supervision ------------------------------------------------------------------------

    async def _watch(self) -> None:
        """Supervise; an unexpected error here gives up (so /health fails) rather than
        leaving the engine unsupervised while the server looks alive."""
        try:
            await self._supervise()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("engine supervision failed")
            self._give_up(f"engine supervision failed: {type(exc).__name__}: {exc}")

    async def _supervise(self) -> None:
        while True:
            reason = await self.engine.wait_closed()
            if self._closing:
                return
            self._down_since = time.monotonic()
            await self.engine.shutdown(timeout=5.0)  # reap the process (kill it if it hangs)
            engine = await self._restart(reason)
            if engine is None:
                return
            self.engine, self._down_since = engine, None

    async def _restart(self, reason: str) -> EngineLife | None:
        failures = 0
        while (why := self._crash_loop(failures)) is None:
            self._attempts.append(time.monotonic())
            self.restarts += 1
            log.error("engine process gone (%s): starting a new one", reason.strip())
            started = time.monotonic()
            try:
                engine = await self.starter(
                    self.model_path, self.policy.start_timeout, **self._restart_options()
                )
            except Exception as exc:
                failures += 1
                reason = str(exc)
                if self._crash_loop(failures) is None:
                    await asyncio.sleep(BACKOFF_SECONDS[min(failures, len(BACKOFF_SECONDS)) - 1])
                continue
            self._start_seconds = time.monotonic() - started
            log.warning("engine process restarted in %.1f s", self._start_seconds)
            return engine
        self._give_up(f"{why}; the last: {reason.strip()}")
        return None

    def _restart_options(self) -> EngineOptions:
        """The engine's options, with the step times its first start measured: a restart
        on the same machine and model need not calibrate again."""
        options = self.engine_options.copy()
        measured = self.engine.info.get("step_times")
        if measured:
            options["step_times"] = measured
        return options

    def _crash_loop(self, failures_in_a_row: int) -> str | None:
        """Why restarting again is no use, or None."""
        limit, window = self.policy.max_restarts, self.policy.window
        now = time.monotonic()
        while self._attempts and now - self._attempts[0] > window:
            self._attempts.popleft()
        if failures_in_a_row >= limit > 0:
            return f"the engine failed to start {failures_in_a_row} times in a row"
        if len(self._attempts) >= limit:
            return f"{len(self._attempts)} engine restarts in {window:g} s (the limit: {limit})"
        return None

    def _give_up(self, message: str) -> None:
        self.gave_up = message
        log.error("giving up on the engine: %s", message)
        if self.on_give_up is not None:
            self.on_give_up(message)
