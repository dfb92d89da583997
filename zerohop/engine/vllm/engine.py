"""vLLM's engine as one zerohop engine life (`zerohop.engine.client.EngineLife`).

vLLM's v1 `AsyncLLM` runs in the API process (its output handler on our event loop, no
HTTP server, no hop) with its EngineCore process under it. Prompts arrive as token ids (the
surfaces render and tokenize them), each request's deltas come back as `RequestDelta`s, and
the caller's tenant, weight and priority class ride on the request to zerohop's scheduler
class inside vLLM's scheduler. When the EngineCore dies, every stream and call fails with
`EngineDeadError`, `wait_closed` returns, and `EngineSupervisor` starts the next life, as
it does for zerohop's own engine process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from typing import Unpack

from vllm.inputs import TokensPrompt
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError

from zerohop.engine.base.errors import EngineDeadError, InvalidRequestError
from zerohop.engine.base.options import EngineOptions
from zerohop.engine.base.outputs import EngineInfo, EngineStatsDict, RequestDelta
from zerohop.engine.client import DEFAULT_OPTIONS, Queued, RequestOptions
from zerohop.engine.sample.sampling_params import SamplingParams
from zerohop.engine.sched.request_options import check_request_options
from zerohop.engine.vllm.engine_args import VllmSetup
from zerohop.engine.vllm.params import vllm_params
from zerohop.engine.vllm.request_tags import RequestTags
from zerohop.engine.vllm.stats import NoPrometheus, StepStats, logger_factory

log = logging.getLogger(__name__)

_WATCH_INTERVAL = 0.5  # seconds between checks that the EngineCore lives


class VllmEngine:
    def __init__(self, llm: AsyncLLM, setup: VllmSetup, stats: StepStats) -> None:
        self._llm, self._setup, self._stats = llm, setup, stats
        self.info: EngineInfo = setup.info(llm)
        self.dead: str | None = None
        self.queued: dict[str, Queued] = {}
        self._internal_ids: dict[str, str] = {}  # ours -> vLLM's (it adds a suffix)
        self._closed = asyncio.Event()
        self._watcher = asyncio.create_task(self._watch())

    @classmethod
    async def start(
        cls, model_path: str, start_timeout: float, **engine_options: Unpack[EngineOptions]
    ) -> VllmEngine:
        """Start vLLM's engine on `model_path` (a GGUF file is exported to a Hugging Face
        folder once): at most `start_timeout` seconds."""
        setup = await asyncio.to_thread(VllmSetup.from_options, model_path, engine_options)
        stats = StepStats()
        build = asyncio.ensure_future(
            asyncio.to_thread(
                AsyncLLM.from_engine_args,
                setup.engine_args,
                stat_loggers=[logger_factory(stats), NoPrometheus],
            )
        )
        try:
            llm = await asyncio.wait_for(asyncio.shield(build), start_timeout)
        except BaseException as exc:
            # Timed out, or the server stops while it starts: the thread still builds an
            # AsyncLLM, whose EngineCore must not outlive this call.
            build.add_done_callback(_shut_down_when_built)
            if isinstance(exc, TimeoutError):
                raise RuntimeError(
                    f"engine failed to start: vLLM not ready within {start_timeout:g} s"
                    " (--engine-start-timeout)"
                ) from None
            raise
        return cls(llm, setup, stats)

    @property
    def latest_stats(self) -> EngineStatsDict | None:
        return self._stats.latest

    @property
    def pid(self) -> int | None:
        manager = self._llm.engine_core.resources.engine_manager
        processes = getattr(manager, "processes", None)
        return processes[0].pid if processes else None

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        announce: bool = False,
        options: RequestOptions = DEFAULT_OPTIONS,
    ) -> AsyncGenerator[RequestDelta, None]:
        """Yield each step's delta for this request; leaving early aborts it in vLLM."""
        if self.dead:
            raise EngineDeadError(self.dead)
        tags, prompt = self._prepare(request_id, prompt_token_ids, params, options)
        sampling = vllm_params(params, tags, self._setup.thinking_supported)
        self.queued[request_id] = options.queued(len(prompt_token_ids))
        collector = None
        finished = False
        try:
            try:
                collector = await self._llm.add_request(request_id, prompt, sampling)
            except VllmEngineDeadError:
                raise EngineDeadError(self._mark_dead("vLLM's engine core died")) from None
            except ValueError as exc:  # vLLM's validation of the request, in its words
                raise InvalidRequestError(str(exc)) from None
            self._internal_ids[request_id] = collector.request_id
            self._stats.requests_added += 1
            if announce:
                yield RequestDelta(
                    request_id, num_prompt_tokens=len(prompt_token_ids), admitted=True
                )
            while not finished:
                try:
                    output = collector.get_nowait() or await collector.get()
                except VllmEngineDeadError:
                    raise EngineDeadError(self._mark_dead("vLLM's engine core died")) from None
                self.queued.pop(request_id, None)
                assert isinstance(output, RequestOutput)  # a generation, not a pooling
                finished = output.finished
                for delta in _deltas(request_id, output, len(prompt_token_ids)):
                    yield delta
        finally:
            self.queued.pop(request_id, None)
            internal = self._internal_ids.pop(request_id, None)
            if collector is not None:
                collector.close()
            if internal is not None and not finished and not self.dead:
                with contextlib.suppress(Exception):
                    await self._llm.abort(internal, internal=True)

    def _prepare(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        options: RequestOptions,
    ) -> tuple[RequestTags, TokensPrompt]:
        if request_id in self._internal_ids or request_id in self.queued:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        tenant, weight, priority = options.tenant, options.weight, options.priority
        salt = options.cache_salt
        check_request_options(tenant, weight, priority, salt)
        if options.continues and params.grammar is not None:
            raise InvalidRequestError(
                "the vLLM engine cannot continue a constrained answer (its grammar state does"
                " not replay the tokens continued)"
            )
        prompt = TokensPrompt(prompt_token_ids=list(prompt_token_ids))
        if salt is not None:
            prompt["cache_salt"] = salt
        return RequestTags(tenant, float(weight), priority), prompt

    def abort(self, request_id: str) -> None:
        internal = self._internal_ids.get(request_id)
        if internal is not None and not self.dead:
            task = asyncio.get_running_loop().create_task(self._llm.abort(internal, internal=True))
            task.add_done_callback(_log_failure)

    async def call(self, name: str) -> EngineStatsDict | None:
        if name == "stats":
            return await self.stats()
        raise InvalidRequestError(f"the vLLM engine has no call {name!r}")

    async def stats(self) -> EngineStatsDict:
        if self.dead:
            raise EngineDeadError(self.dead)
        latest = self._stats.latest
        if latest is None:  # configured when the engine was built: not before start returns
            raise EngineDeadError("vLLM's engine has not reported its configuration")
        return latest.copy()

    async def wait_closed(self) -> str:
        await self._closed.wait()
        return self.dead or "vLLM's engine stopped"

    async def _watch(self) -> None:
        while not self._closed.is_set():
            if self._llm.errored:
                self._mark_dead("vLLM's engine core died")
                return
            await asyncio.sleep(_WATCH_INTERVAL)

    def _mark_dead(self, reason: str, expected: bool = False) -> str:
        if self.dead is None:
            self.dead = reason
            if not expected:
                log.error("%s", reason)
            self._closed.set()
        return self.dead

    async def shutdown(self, timeout: float = 10.0) -> None:
        self._mark_dead("the engine was shut down", expected=True)
        self._watcher.cancel()
        # vLLM cancels its output handler after stopping the EngineCore, which the handler
        # would first report as a death (a traceback in the log of every clean stop).
        handler = self._llm.output_handler
        if handler is not None:
            handler.cancel()
        started = time.monotonic()
        await asyncio.to_thread(self._llm.shutdown, timeout)
        log.info("vLLM's engine shut down in %.1f s", time.monotonic() - started)


def _deltas(request_id: str, output: RequestOutput, prompt_tokens: int) -> list[RequestDelta]:
    """One delta per choice that moved in this output."""
    cached = output.num_cached_tokens or 0
    return [_delta(request_id, choice, prompt_tokens, cached) for choice in output.outputs]


def _delta(
    request_id: str, choice: CompletionOutput, prompt_tokens: int, cached: int
) -> RequestDelta:
    logprobs = None
    if choice.logprobs is not None:
        logprobs = [
            {int(token): float(entry.logprob) for token, entry in position.items()}
            for position in choice.logprobs
        ]
    reason = choice.finish_reason
    return RequestDelta(
        request_id,
        new_token_ids=list(choice.token_ids),
        new_text=choice.text,
        new_logprobs=logprobs,
        finished=reason is not None,
        finish_reason=reason,
        stop_reason=choice.stop_reason,
        num_prompt_tokens=prompt_tokens,
        cached_tokens=cached,
        index=choice.index,
    )


def _shut_down_when_built(build: asyncio.Future[AsyncLLM]) -> None:
    if not build.cancelled() and build.exception() is None:
        build.result().shutdown()


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("vLLM abort failed: %s", task.exception())
