"""One response encoded from the generation driver's events: its output items, its status and
usage, the stream's events (output.py), and the response kept in the store as it goes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from zerohop.api.compaction.summarize import Summary
from zerohop.api.conversation.planner import Plan
from zerohop.api.conversation.request import Conversation
from zerohop.api.errors import ApiError
from zerohop.api.generation.continued import continued_thought_tokens
from zerohop.api.generation.driver import Generation
from zerohop.api.generation.events import Admitted, Finish, Step, Usage
from zerohop.api.openai.stream import PING
from zerohop.api.responses.output import EventWriter, OutputItems
from zerohop.api.responses.schema import ResponsesRequest
from zerohop.api.responses.stored import StoredResponses
from zerohop.api.responses.tools import Choice, RequestTools
from zerohop.gateway.gateway import Call


@dataclass(slots=True)
class Prepared:
    """A request made ready to run: its conversation's plan, the items it saw, its tools."""

    request: ResponsesRequest
    planned: Plan
    items: list[Any]
    tools: RequestTools
    choice: Choice
    conversation: Conversation | None = None
    leading: list[Any] = field(default_factory=list)  # output items before the answer's
    summary: Summary | None = None  # a compaction_trigger's: the response is `leading` only


# A failed response's `error.code` (the API's codes), by the failure's HTTP status: a 5xx
# is the server's `server_error` (zerohop.client fails over on it), any other the request's.
_FAILED_CODES = {429: "rate_limit_exceeded"}


class ResponseEncoder:
    """One response: its output read from the generation's steps, streamed or whole, and
    kept (`store`: None when it is not)."""

    ping = PING

    def __init__(self, ready: Prepared, call: Call, body: dict[str, Any]) -> None:
        self.ready, self.call, self.body = ready, call, body
        self.tenant = call.identity.tenant.name
        self.store: StoredResponses | None = None
        self.write = EventWriter(False)
        self.items = OutputItems(ready.tools, self.write, ready.choice.raw_call is not None)
        self.items.items.extend(ready.leading)  # a compaction item (compact.py)
        # The generation's own usage, set by the surface: a failure reports the usage so far.
        self.usage = Usage(len(ready.planned.prompt))
        self.token_ids = bool(ready.request.return_token_ids)
        self.held_ids: list[int] = []  # a step's ids that wrote no event: go with the next

    def resume(self, generation: Generation) -> None:
        """Continue another replica's answer (`continue_token_ids`): the continued part's
        items are built, without events (the caller has them), so the stream goes on in the
        same item at the same output index (zerohop.client renames its ids to the first
        replica's and drops this stream's `response.created` / `in_progress`). The continued
        thought tokens count as reasoning tokens, as in an uninterrupted run (the client
        counts the continued tokens as output, not input)."""
        self.items.feed(generation.resumed)
        generation.usage.thought_tokens = continued_thought_tokens(generation)

    async def whole(self, generation: Generation) -> None:
        async for step in generation.steps():
            self.step(step)

    # -- streamed (generation/sse.py) ------------------------------------------------------

    def opening(self, admitted: Admitted) -> bytes:
        self.write.enabled = True
        # `return_token_ids` (zerohop.client): the input's usage, for an end the client writes
        # itself when a replica fails with no output tokens left to continue.
        extra = {"usage": usage_body(admitted.usage)} if self.token_ids else {}
        opening = self.write("response.created", response=self.body, **extra)
        opening += self.write("response.in_progress", response=self.body)
        for index, item in enumerate(self.ready.leading):  # a compaction item: no deltas
            opening += self.write("response.output_item.added", output_index=index, item=item)
            opening += self.write("response.output_item.done", output_index=index, item=item)
        return opening

    def step(self, step: Step) -> bytes:
        data = self.items.feed(step.output)
        if step.finish is not None:
            data += self._finish(step.finish)
        return self._with_ids(data, step.token_ids) if self.token_ids else data

    def _with_ids(self, data: bytes, token_ids: list[int]) -> bytes:
        """`return_token_ids`: the step's token ids (and those of steps before it that wrote
        nothing) as a `token_ids` field of its last event, which the SDKs ignore."""
        self.held_ids.extend(token_ids)
        if not data or not self.held_ids:
            return data
        assert data.endswith(b"}\n\n")
        ids, self.held_ids = orjson.dumps(self.held_ids), []
        return data[:-3] + b',"token_ids":' + ids + b"}\n\n"

    async def closing(self) -> bytes:
        await self.keep()
        cut = self.body["status"] == "incomplete"
        kind = "response.incomplete" if cut else "response.completed"
        return self.write(kind, response=self.body)

    def failed(self, error: ApiError) -> bytes:
        self.fail(error)
        return self.write("response.failed", response=self.body)

    # -- the response ----------------------------------------------------------------------

    def _finish(self, finish: Finish) -> bytes:
        """The response's end: its status and usage."""
        status = "incomplete" if finish.truncated else "completed"
        data = self.items.finish(status)
        self.body.update(
            status=status,
            completed_at=int(time.time()) if status == "completed" else None,
            incomplete_details={"reason": "max_output_tokens"} if finish.truncated else None,
            output=self.items.items,
            usage=self._usage(),
        )
        return data

    def fail(self, error: ApiError) -> None:
        # The open item closed `incomplete` with its text so far, without events.
        enabled, self.write.enabled = self.write.enabled, False
        self.items.finish("incomplete")
        self.write.enabled = enabled
        self.body.update(
            status="failed",
            error={
                "code": _failed_code(error.status),
                "message": error.message,
            },
            output=self.items.items,
            usage=self._usage(),
        )

    async def keep_failed(self) -> None:
        """Keep a streamed response that failed (status `failed`, its `error`)."""
        if self.body["status"] == "failed":
            await self.keep()

    async def keep(self) -> bool:
        """Store the response as it is now; False when it is not kept."""
        if self.store is None:
            return False
        return await self.store.put(self.tenant, self.body, self.ready.items)

    def _usage(self) -> dict[str, Any]:
        return usage_body(self.usage)


def _failed_code(status: int) -> str:
    return "server_error" if status >= 500 else _FAILED_CODES.get(status, "invalid_prompt")


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": usage.cached_tokens,
            "cache_write_tokens": 0,
        },
        "output_tokens": usage.output_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.thought_tokens},
        "total_tokens": usage.prompt_tokens + usage.output_tokens,
    }
