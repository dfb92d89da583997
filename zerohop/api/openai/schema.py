"""OpenAI request bodies: msgspec Structs, decoding with OpenAI-shaped errors, and the checks
that turn a request into a prompt and SamplingParams.

Unknown top-level fields are rejected, as the OpenAI API does ("Unrecognized request argument
supplied"); vLLM ignores them, but a silently ignored misspelt `max_token` is worse than a 400.
Parameters the API defines but this server does not implement are accepted at their neutral
value (text-only modalities, no audio, ...) and rejected with a clear 400
otherwise; bookkeeping fields (`user`, `metadata`, `store`, ...) are accepted and ignored.
An explicit `null` is the field's default, as if absent (`null_defaults`).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, TypeVar

import msgspec

from zerohop.api.conversation.request import Role
from zerohop.api.errors import ApiError
from zerohop.api.http.null_defaults import NullMeansDefault
from zerohop.api.serving.service import sampling_params as build_sampling_params
from zerohop.engine.sample.sampling_params import MAX_N, SamplingParams

MAX_TOP_LOGPROBS = 20  # chat `top_logprobs`
MAX_LEGACY_LOGPROBS = 5  # completions `logprobs`
T = TypeVar("T")
CHAT_ROLES: dict[str, Role] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
}


class StreamOptions(NullMeansDefault):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # nothing to obfuscate: accepted, ignored
    continuous_usage_stats: bool | None = None  # vLLM's; accepted, ignored


class StructuredOutputs(NullMeansDefault, forbid_unknown_fields=True):
    json: Any = None  # a JSON schema (object or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark or GBNF/EBNF
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None  # accepted; whitespace is always bounded
    disable_additional_properties: bool | None = None  # accepted; always the case


class ContentPart(NullMeansDefault):
    type: str
    text: str | None = None


class Message(NullMeansDefault):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None  # accepted, not rendered (as in vLLM's default templates)
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    # An assistant turn's thought, as vLLM takes it back (`reasoning`, its older name
    # `reasoning_content`): rendered when the turn is of the current tool loop (planner.py).
    reasoning: str | None = None
    reasoning_content: str | None = None


class _Common(NullMeansDefault, forbid_unknown_fields=True, kw_only=True):
    model: str
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's sampling extras (the SDK sends them through `extra_body`).
    top_k: int | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = True
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    # vLLM's constraint extension: exactly one of json, regex, choice, grammar, json_object.
    structured_outputs: StructuredOutputs | None = None
    # Scheduling: "flex" (OpenAI) or a vLLM `priority` above 0 runs the request as batch work.
    service_tier: str | None = None
    priority: int | None = None
    # vLLM's `return_token_ids` (each chunk's choice carries its tokens' ids) and zerohop's
    # failover extension: continue another replica's partial answer from its token ids.
    return_token_ids: bool | None = False
    continue_token_ids: list[int] | None = None

    @property
    def wants_batch(self) -> bool:
        return self.service_tier == "flex" or (self.priority or 0) > 0


class ChatRequest(_Common, kw_only=True):
    messages: list[Message]
    max_tokens: int | None = None
    # vLLM's: the thought of a reasoning model is closed by force after this many tokens.
    thinking_token_budget: Annotated[int, msgspec.Meta(ge=0)] | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # Accepted and ignored: bookkeeping that does not change the output.
    metadata: Any = None
    store: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    safety_identifier: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    # Tools: checked as they map onto the conversation (tools.py).
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # Defined by the API, supported only at their neutral value (see `check_chat`).
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    moderation: Any = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


_AT = re.compile(r" - at `\$\.?([^`]*)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `([^`]*)`")
_MISSING = re.compile(r"^Object missing required field `([^`]*)`")
_NULL = re.compile(r"^Expected `[^`]*`, got `null`$")  # a required field sent as null


def decode(body: bytes, kind: type[T]) -> T:
    """The body as `kind`; 400 in OpenAI's words for bad JSON, bad UTF-8, types, fields."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise _validation_error(str(exc)) from None
    except msgspec.DecodeError as exc:
        try:
            body.decode("utf-8")
        except UnicodeDecodeError:
            raise ApiError(400, "the request body is not valid UTF-8") from None
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None


def _validation_error(text: str) -> ApiError:
    at = _AT.search(text)
    path = at.group(1) if at else ""
    message = text[: at.start()] if at else text
    if m := _UNKNOWN.match(message):
        name = f"{path}.{m.group(1)}" if path else m.group(1)
        return ApiError(400, f"Unrecognized request argument supplied: {name}", param=name)
    if m := _MISSING.match(message):
        name = f"{path}.{m.group(1)}" if path else m.group(1)
        return ApiError(400, f"Missing required parameter: '{name}'.", param=name)
    if _NULL.match(message) and path and not path.endswith("]"):
        return ApiError(400, f"Missing required parameter: '{path}'.", param=path)
    if not path:
        return ApiError(400, f"invalid request body: {message}")
    return ApiError(400, f"Invalid value for '{path}': {message}", param=path)


def message_text(index: int, message: Message) -> tuple[Role, str]:
    """A message's role and its text, as the chat template wants them (known roles, text
    parts joined); turns.py maps tool calls and results."""
    where = f"messages[{index}]"
    role = CHAT_ROLES.get(message.role)
    if role is None:
        raise ApiError(
            400,
            f"{where}.role: '{message.role}' is not supported;"
            " use system, developer, user, assistant or tool",
            param=f"{where}.role",
        )
    if message.tool_calls or message.tool_call_id:
        raise ApiError(
            400,
            f"{where}: only an assistant message makes tool calls (tool_calls) and only a tool"
            " message answers one (tool_call_id)",
            param=where,
        )
    content = message.content
    if content is None:
        if role != "assistant":
            raise ApiError(400, f"{where}.content is required", param=f"{where}.content")
        content = ""
    elif isinstance(content, list):
        content = "".join(_text_part(f"{where}.content[{j}]", p) for j, p in enumerate(content))
    return role, content


def _text_part(where: str, part: ContentPart) -> str:
    if part.type != "text" or part.text is None:
        raise ApiError(
            400,
            f"{where}: content parts of type '{part.type}' are not supported, only"
            " {'type': 'text', 'text': ...}",
            param=where,
        )
    return part.text


def _unsupported(param: str, detail: str) -> ApiError:
    return ApiError(400, f"{param}: {detail} is not supported by this server", param=param)


def _check_common(request: _Common) -> None:
    if request.temperature is not None and not 0 <= request.temperature <= 2:
        raise ApiError(400, "temperature must be between 0 and 2", param="temperature")
    if request.n is not None and not 1 <= request.n <= MAX_N:
        raise ApiError(400, f"n must be between 1 and {MAX_N}, got {request.n}", param="n")
    if request.stream_options is not None and not request.stream:
        raise ApiError(
            400, "stream_options is only allowed when stream is true", param="stream_options"
        )


def check_chat(request: ChatRequest) -> None:
    _check_common(request)
    # tools, tool_choice and tool turns are checked as they map (tools.py, turns.py).
    if request.functions:
        raise _unsupported("functions", "the deprecated functions (use tools)")
    if request.function_call not in (None, "none", "auto"):
        raise _unsupported("function_call", "the deprecated function_call (use tool_choice)")
    # response_format and structured_outputs are checked as they compile (output_format.py).
    if request.modalities and set(request.modalities) != {"text"}:
        raise _unsupported("modalities", "output other than text")
    for name in ("audio", "prediction", "web_search_options"):
        if getattr(request, name) is not None:
            raise _unsupported(name, name)
    top = request.top_logprobs
    if top is not None:
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ApiError(
                400, f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", "top_logprobs"
            )
        if top and not request.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs to be true", "top_logprobs")


def check_completion(request: CompletionRequest) -> None:
    _check_common(request)
    if request.best_of not in (None, 1):
        raise _unsupported("best_of", f"best_of={request.best_of}")
    if request.suffix:
        raise _unsupported("suffix", "suffix")
    if request.logprobs is not None and not 0 <= request.logprobs <= MAX_LEGACY_LOGPROBS:
        raise ApiError(400, f"logprobs must be between 0 and {MAX_LEGACY_LOGPROBS}", "logprobs")
    if request.echo and request.logprobs is not None:
        raise _unsupported("echo", "echo together with logprobs (no prompt logprobs)")


def chat_max_tokens(request: ChatRequest) -> int | None:
    value = request.max_completion_tokens
    return request.max_tokens if value is None else value


def completion_prompt(request: CompletionRequest, vocab_size: int) -> str | list[int]:
    """One prompt: a string or token ids (a one-element batch of either is fine too)."""
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(
                400,
                f"prompt: a batch of {len(prompt)} prompts is not supported; send one per request",
                param="prompt",
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if not prompt:
        raise ApiError(400, "prompt: the token list is empty", param="prompt")
    if not all(type(t) is int and 0 <= t < vocab_size for t in prompt):
        raise ApiError(
            400, f"prompt: token ids must be integers in [0, {vocab_size})", param="prompt"
        )
    return prompt


def logit_bias(request: _Common, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's {"token id": bias} as {id: bias}, each id a token of this model."""
    if not request.logit_bias:
        return None
    out = {}
    for key, bias in request.logit_bias.items():
        if not key.isdigit() or int(key) >= vocab_size:
            raise ApiError(
                400,
                f"logit_bias: {key!r} is not a token id of this model (0 to {vocab_size - 1})",
                param="logit_bias",
            )
        out[int(key)] = bias
    return out


def sampling_params(
    request: _Common,
    max_tokens: int | None,
    logprobs: int | None,
    vocab_size: int,
    grammar: str | None = None,
) -> SamplingParams:
    return build_sampling_params(
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=1.0
        if request.repetition_penalty is None
        else request.repetition_penalty,
        min_p=request.min_p or 0.0,
        logit_bias=logit_bias(request, vocab_size),
        min_tokens=request.min_tokens or 0,
        bad_words=request.bad_words or None,
        allowed_token_ids=request.allowed_token_ids,
        n=1 if request.n is None else request.n,
        grammar=grammar,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        seed=request.seed,
        max_tokens=max_tokens,
        stop=request.stop,
        stop_token_ids=request.stop_token_ids or [],
        ignore_eos=request.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=request.skip_special_tokens,
    )
