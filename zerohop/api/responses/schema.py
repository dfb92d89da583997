"""A Responses API request body (`POST /v1/responses`), decoded with OpenAI-shaped errors.

The API moves fast and its clients send fields no SDK names yet (Codex's `client_metadata`),
so fields this server does not read are accepted and ignored rather than refused; the ones it
reads are typed here, and their values are checked where they are mapped (items.py,
tools.py, surface.py). `input` items, `tools` and `tool_choice` stay raw JSON values here:
their many shapes are told apart by their `type` when they are mapped, so that an item type
added to the API later is skipped, not a 400.
"""

from __future__ import annotations

import math
import re
from typing import Any

from zerohop.api.errors import ApiError
from zerohop.api.http.null_defaults import NullMeansDefault
from zerohop.api.openai.schema import decode

TRUNCATIONS = ("auto", "disabled")
PENALTIES = ("presence_penalty", "frequency_penalty")  # OpenAI's range: -2.0 to 2.0
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
RESPONSE_ID = re.compile(r"resp_[A-Za-z0-9_-]{1,128}")


class Reasoning(NullMeansDefault):
    effort: str | None = None
    summary: str | None = None  # auto / concise / detailed: accepted (thoughts are whole)
    generate_summary: str | None = None  # the older name of `summary`


class TextConfig(NullMeansDefault):
    format: dict[str, Any] | None = None  # text / json_object / json_schema (flattened)
    verbosity: str | None = None  # low / medium / high: accepted, ignored


class ResponsesRequest(NullMeansDefault):
    model: str | None = None
    input: str | list[Any] | None = None
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    top_logprobs: int | None = None
    store: bool = True  # the API's default: a response is kept unless told otherwise
    previous_response_id: str | None = None
    truncation: str = "disabled"
    prompt_cache_key: str | None = None  # a routing hint for zerohop.client, never a salt
    stream: bool = False
    background: bool = False
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    seed: int | None = None  # vLLM's extension: reproducible sampling
    context_management: list[Any] | None = None  # compaction (compact.py)
    # zerohop.client's failover (zerohop extensions, as on Messages and Chat): each event
    # with output carries its step's `token_ids`; a continuation resumes after the given ones.
    return_token_ids: bool = False
    continue_token_ids: list[int] | None = None
    # The id the caller holds of the response a continuation goes on with (an empty
    # `continue_token_ids`: starts over): stored under it (surface.py, `_claim`).
    continue_response_id: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.truncation not in TRUNCATIONS:
            raise _invalid("truncation", f"must be one of {', '.join(TRUNCATIONS)}")
        effort = self.reasoning.effort if self.reasoning else None
        if effort is not None and effort not in EFFORTS:
            raise _invalid("reasoning.effort", f"must be one of {', '.join(EFFORTS)}")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise _invalid("max_output_tokens", "must be at least 1")
        for name in PENALTIES:
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise _invalid(name, f"must be between -2.0 and 2.0, got {value}")
        if self.background and not self.store:
            raise _invalid("background", "background responses must be stored (store: true)")
        self._check_continued_id()

    def _check_continued_id(self) -> None:
        wanted = self.continue_response_id
        if wanted is None:
            return
        if self.continue_token_ids is None:
            raise _invalid("continue_response_id", "only with continue_token_ids")
        if not RESPONSE_ID.fullmatch(wanted):
            raise _invalid("continue_response_id", "must be a response id (resp_...)")


def decode_request(body: bytes) -> ResponsesRequest:
    request = decode(body, ResponsesRequest)
    if not request.model:
        raise ApiError(400, "Missing required parameter: 'model'.", param="model")
    return request


def _invalid(name: str, problem: str) -> ApiError:
    return ApiError(400, f"Invalid value for '{name}': {problem}", param=name)
