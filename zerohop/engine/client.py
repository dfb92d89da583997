"""The seam between the surfaces and an engine: what the API process calls, whichever engine
runs (zerohop's own in its engine process, or vLLM's `AsyncLLM`).

`EngineLife` is one engine's life (a process that can die); `EngineSupervisor` restarts lives
and is the `EngineClient` the surfaces, the gateway and admission hold. Deltas are typed
(`RequestDelta`: token ids, text, cached prompt tokens, logprobs, a finish reason), the
caller's scheduling view is typed (`RequestOptions`), and the engine's counters are
`EngineStats` fields. Torch-free and vLLM-free.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Protocol, Unpack

from zerohop.engine.base.options import EngineOptions
from zerohop.engine.base.outputs import EngineInfo, EngineStatsDict, RequestDelta
from zerohop.engine.sample.sampling_params import SamplingParams


@dataclass(slots=True, frozen=True)
class RequestOptions:
    """The scheduler's view of a request's caller, and what its prompt continues."""

    tenant: str = "default"
    weight: float = 1.0
    priority: int = 0  # zerohop.engine.sched.fair_share: INTERACTIVE, BATCH, BACKGROUND
    cache_salt: str | None = None  # prompts with other salts never share cached blocks
    continues: tuple[int, ...] = ()  # the prompt ends with these tokens of an earlier answer

    def queued(self, prompt_tokens: int) -> Queued:
        return Queued(prompt_tokens, self.tenant, self.weight, self.priority)


DEFAULT_OPTIONS = RequestOptions()


@dataclass(slots=True, frozen=True)
class Queued:
    """A request sent to the engine whose first delta has not come back."""

    prompt_tokens: int
    tenant: str
    weight: float
    priority: int


class EngineLife(Protocol):
    """One engine's life: serves until it dies or is shut down."""

    @property
    def info(self) -> EngineInfo:
        """vocab_size, max_model_len, block_size, engine (its name when not zerohop's), ..."""

    @property
    def latest_stats(self) -> EngineStatsDict | None:
        """The engine's counters after the latest step."""

    @property
    def dead(self) -> str | None:
        """Why nothing can be served; None while serving."""

    @property
    def queued(self) -> dict[str, Queued]:
        """Requests sent whose first delta has not come back."""

    @property
    def pid(self) -> int | None: ...

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        announce: bool = False,
        options: RequestOptions = DEFAULT_OPTIONS,
    ) -> AsyncGenerator[RequestDelta, None]: ...

    def abort(self, request_id: str) -> None: ...

    async def call(self, name: str) -> EngineStatsDict | None: ...

    async def stats(self) -> EngineStatsDict: ...

    async def wait_closed(self) -> str: ...

    async def shutdown(self, timeout: float = 10.0) -> None: ...


class EngineStarter(Protocol):
    """Starts one engine life on a model within `start_timeout` seconds (else raises)."""

    async def __call__(
        self, model_path: str, start_timeout: float, **engine_options: Unpack[EngineOptions]
    ) -> EngineLife: ...


class EngineClient(Protocol):
    """What the surfaces, gateway and admission hold: a supervised engine."""

    restarts: int
    gave_up: str | None
    on_give_up: Callable[[str], None] | None

    @property
    def dead(self) -> str | None: ...

    @property
    def info(self) -> EngineInfo: ...

    @property
    def latest_stats(self) -> EngineStatsDict | None: ...

    @property
    def queued(self) -> dict[str, Queued]: ...

    @property
    def pid(self) -> int | None: ...

    def retry_after(self) -> float: ...

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        announce: bool = False,
        options: RequestOptions = DEFAULT_OPTIONS,
    ) -> AsyncGenerator[RequestDelta, None]: ...

    def abort(self, request_id: str) -> None: ...

    async def call(self, name: str) -> EngineStatsDict | None: ...

    async def stats(self) -> EngineStatsDict: ...

    async def shutdown(self, timeout: float = 10.0) -> None: ...
