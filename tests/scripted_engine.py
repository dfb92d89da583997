"""An engine client that replays a script of deltas (or raises a scripted error), for tests
of what the generation driver and the surfaces' encoders make of engine output that a tiny
random model cannot be made to produce on demand (a failure mid-stream, a given tool call)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from zerohop.api.conversation.events import OutputReader
from zerohop.api.generation.driver import Generation, GenerationRequest
from zerohop.api.serving.output_length import Api
from zerohop.api.serving.service import ServingContext
from zerohop.engine.base.outputs import RequestDelta
from zerohop.engine.sample.sampling_params import SamplingParams
from zerohop.engine.text.tokenizer import Tokenizer
from zerohop.gateway.gateway import Call


class ScriptedEngine:
    """Yields `script`'s deltas in order; an exception in it is raised there."""

    dead = None
    latest_stats = None

    def __init__(self, script: list[RequestDelta | Exception]) -> None:
        self.script = script
        self.info: dict[str, Any] = {"vocab_size": 512}
        self.aborted: list[str] = []

    async def generate(self, request_id: str, *args: Any) -> AsyncIterator[RequestDelta]:
        for item in self.script:
            await asyncio.sleep(0)
            if isinstance(item, Exception):
                raise item
            yield item

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def retry_after(self) -> float:
        return 1.0


def scripted_generation(
    tokenizer: Tokenizer | None,
    script: list[RequestDelta | Exception],
    api: Api = "chat",
    n: int = 1,
    readers: Callable[[], OutputReader] | None = None,
    stream: bool = True,
) -> Generation:
    """A generation of a three-token prompt whose engine plays `script`."""
    engine: Any = ScriptedEngine(script)
    ctx = ServingContext(engine, tokenizer, "m", 2048)  # type: ignore[arg-type]
    wanted = GenerationRequest(api, [1, 2, 3], SamplingParams(max_tokens=64, n=n), readers)
    return Generation(ctx, Call("req_x", "openai"), wanted, stream=stream)
