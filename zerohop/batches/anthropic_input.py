"""A Message Batches create body, checked where it enters: the whole request is refused (400)
for what the API refuses whole; a line whose params cannot run is an `errored` line.

Params are otherwise validated when the line runs, by the same handler `POST /v1/messages`
uses, so a bad line gets exactly the error an HTTP request would.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from zerohop.api.errors import ApiError
from zerohop.api.serving.model_names import ModelNames
from zerohop.batches.records import ERRORED, NewLine
from zerohop.batches.results import refused

MAX_REQUESTS = 100_000  # the API reference's maxItems
CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def parse_create(body: bytes, names: ModelNames) -> list[NewLine]:
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(document, dict) or not isinstance(document.get("requests"), list):
        raise ApiError(400, "requests: Field required (a list of {custom_id, params})")
    requests = document["requests"]
    if not 1 <= len(requests) <= MAX_REQUESTS:
        raise ApiError(400, f"requests: between 1 and {MAX_REQUESTS} items, not {len(requests)}")
    lines, seen = [], set()
    for index, request in enumerate(requests):
        custom_id, params = _request(index, request)
        if custom_id in seen:
            raise ApiError(400, f"requests.{index}.custom_id: {custom_id!r} is not unique")
        seen.add(custom_id)
        lines.append(_line(custom_id, params, names))
    return lines


def _request(index: int, request: Any) -> tuple[str, dict[str, Any]]:
    where = f"requests.{index}"
    if not isinstance(request, dict):
        raise ApiError(400, f"{where}: an object with custom_id and params")
    custom_id, params = request.get("custom_id"), request.get("params")
    if not isinstance(custom_id, str) or not CUSTOM_ID.fullmatch(custom_id):
        raise ApiError(400, f"{where}.custom_id: 1 to 64 characters of a-z, A-Z, 0-9, _ and -")
    if not isinstance(params, dict):
        raise ApiError(400, f"{where}.params: an object (a Messages request)")
    return custom_id, params


def _line(custom_id: str, params: dict[str, Any], names: ModelNames) -> NewLine:
    if params.get("stream") is True:
        error = ApiError(400, "stream: batch requests cannot stream")
    elif isinstance(params.get("model"), str) and not names.accepts(params["model"]):
        error = ApiError(404, f"model: {params['model']} (this server serves '{names.primary}')")
    else:
        return NewLine(custom_id, orjson.dumps(params).decode())
    return NewLine(custom_id, orjson.dumps(params).decode(), ERRORED, refused(error))
