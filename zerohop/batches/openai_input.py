"""An OpenAI `POST /v1/batches` body and its input file, checked where they enter.

The body is refused whole (400) for what the API refuses at once: a missing or unknown
`input_file_id`, an endpoint other than chat or text completions, a window other than 24h,
bad metadata. The input file's problems (a line that is not JSON, a duplicate `custom_id`,
a line for another endpoint, two models in one file) fail the batch as the API does: it is
created `failed`, with `errors.data` naming each line. A line that cannot run on this server
(another model, `stream: true`) is an error-file line; the rest are validated when they run,
by the handler the endpoint's HTTP requests take.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from zerohop.api.errors import ApiError
from zerohop.api.serving.model_names import ModelNames
from zerohop.batches.records import ERRORED, NewLine
from zerohop.batches.results import refused

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MAX_LINES = 50_000  # the API's limit per batch
MAX_CUSTOM_ID = 512
MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
MAX_ERRORS = 100  # errors.data entries kept for a failed batch


@dataclass(slots=True, frozen=True)
class CreateBody:
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None


@dataclass(slots=True)
class InputFile:
    lines: list[NewLine] = field(default_factory=list)
    model: str | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)

    def fail(self, code: str, message: str, line: int | None, param: str | None = None) -> None:
        if len(self.errors) < MAX_ERRORS:
            self.errors.append({"code": code, "line": line, "message": message, "param": param})


def parse_create(body: bytes) -> CreateBody:
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise ApiError(400, "the request body must be a JSON object")
    input_file_id = document.get("input_file_id")
    if not isinstance(input_file_id, str) or not input_file_id:
        raise ApiError(400, "input_file_id: a file id is required", param="input_file_id")
    endpoint = document.get("endpoint")
    if endpoint not in ENDPOINTS:
        message = f"endpoint: one of {', '.join(ENDPOINTS)} (this server), not {endpoint!r}"
        raise ApiError(400, message, param="endpoint")
    window = document.get("completion_window")
    if window != "24h":
        raise ApiError(400, f"completion_window: '24h', not {window!r}", param="completion_window")
    metadata = _metadata(document.get("metadata"))
    _output_expires_after(document.get("output_expires_after"))
    return CreateBody(input_file_id, endpoint, window, metadata)


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_METADATA_KEYS:
        raise ApiError(400, "metadata: an object of at most 16 pairs", param="metadata")
    for key, item in value.items():
        short = len(key) <= MAX_METADATA_KEY
        if not short or not isinstance(item, str) or len(item) > MAX_METADATA_VALUE:
            message = "metadata: string keys up to 64 characters, string values up to 512"
            raise ApiError(400, message, param="metadata")
    return value


def _output_expires_after(value: Any) -> None:
    """Accepted as the API takes it; the output files are kept until deleted."""
    if value is None:
        return
    seconds = value.get("seconds") if isinstance(value, dict) else None
    valid = isinstance(value, dict) and value.get("anchor") == "created_at"
    if not valid or not isinstance(seconds, int) or not 3600 <= seconds <= 2_592_000:
        message = "output_expires_after: {anchor: 'created_at', seconds: 3600 to 2592000}"
        raise ApiError(400, message, param="output_expires_after")


def parse_input_file(content: bytes, endpoint: str, names: ModelNames) -> InputFile:
    parsed = InputFile()
    seen: set[str] = set()
    for number, raw in enumerate(content.splitlines(), start=1):
        if not raw.strip():
            continue
        if len(parsed.lines) + 1 > MAX_LINES:
            parsed.fail("too_many_requests", f"more than {MAX_LINES} requests", number)
            break
        request = _request(parsed, raw, number, endpoint)
        if request is None:
            continue
        custom_id, body = request
        if custom_id in seen:
            parsed.fail("duplicate_custom_id", f"custom_id {custom_id!r} is not unique", number)
            continue
        seen.add(custom_id)
        _check_model(parsed, body, number)
        parsed.lines.append(_line(custom_id, body, names))
    if not parsed.lines and not parsed.errors:
        parsed.fail("empty_file", "the input file holds no requests", None)
    return parsed


def _request(
    parsed: InputFile, raw: bytes, number: int, endpoint: str
) -> tuple[str, dict[str, Any]] | None:
    try:
        request = orjson.loads(raw)
    except orjson.JSONDecodeError:
        parsed.fail("invalid_json_line", "this line is not valid JSON", number)
        return None
    if not isinstance(request, dict):
        parsed.fail("invalid_request", "a line is an object: custom_id, method, url, body", number)
        return None
    custom_id, body = request.get("custom_id"), request.get("body")
    if not isinstance(custom_id, str) or not 1 <= len(custom_id) <= MAX_CUSTOM_ID:
        message = f"custom_id: a string of 1 to {MAX_CUSTOM_ID} characters"
        parsed.fail("invalid_custom_id", message, number, "custom_id")
    elif request.get("method") != "POST":
        parsed.fail("invalid_method", "method: 'POST'", number, "method")
    elif request.get("url") != endpoint:
        message = f"url: {request.get('url')!r} is not the batch's endpoint {endpoint}"
        parsed.fail("invalid_url", message, number, "url")
    elif not isinstance(body, dict):
        parsed.fail("invalid_body", "body: an object (the request's JSON body)", number, "body")
    else:
        return custom_id, body
    return None


def _check_model(parsed: InputFile, body: dict[str, Any], number: int) -> None:
    model = body.get("model")
    if not isinstance(model, str):
        return  # the line's own 400 when it runs
    if parsed.model is None:
        parsed.model = model
    elif model != parsed.model:
        message = f"model {model!r}: every request of a batch uses one model ({parsed.model!r})"
        parsed.fail("mismatched_model", message, number, "body.model")


def _line(custom_id: str, body: dict[str, Any], names: ModelNames) -> NewLine:
    params = orjson.dumps(body).decode()
    if body.get("stream") is True:
        error = ApiError(400, "stream: batch requests cannot stream", param="stream")
    elif isinstance(body.get("model"), str) and not names.accepts(body["model"]):
        message = f"The model `{body['model']}` does not exist."
        error = ApiError(404, message, param="model", code="model_not_found")
    else:
        return NewLine(custom_id, params)
    return NewLine(custom_id, params, ERRORED, refused(error, "openai"))
