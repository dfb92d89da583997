"""A line's stored result, and what each API makes of the finished lines: Anthropic's results
stream (`wire.result_line`) or OpenAI's output and error files, written when a batch ends.

A stored result is neutral, `{"status_code", "request_id", "body"}`, the body already in its
API's own shape (a Message or chat.completion, or that API's error JSON).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from zerohop.api.errors import ApiError, anthropic_body, openai_body
from zerohop.api.serving.service import new_request_id
from zerohop.batches.records import (
    CANCELED,
    EXPIRED,
    SUCCEEDED,
    BatchRecord,
    LineRecord,
    NewFile,
)

NOT_RUN = {
    CANCELED: ("batch_cancelled", "the batch was cancelled before this request ran"),
    EXPIRED: ("batch_expired", "the batch expired before this request ran"),
}


def api_of(endpoint: str) -> str:
    return "anthropic" if endpoint == "/v1/messages" else "openai"


def refused(
    error: ApiError, api: str = "anthropic", request_id: str | None = None
) -> dict[str, Any]:
    """A line's stored result for an error: the status and the API's own error body."""
    request_id = request_id or new_request_id()
    shape = anthropic_body if api == "anthropic" else openai_body
    return {"status_code": error.status, "request_id": request_id, "body": shape(error, request_id)}


def openai_line(line: LineRecord) -> dict[str, Any]:
    """One line of an OpenAI output or error file (the API's BatchRequestOutput)."""
    entry: dict[str, Any] = {
        "id": f"batch_req_{secrets.token_hex(16)}",
        "custom_id": line.custom_id,
    }
    if line.state in NOT_RUN:
        code, message = NOT_RUN[line.state]
        return {**entry, "response": None, "error": {"code": code, "message": message}}
    stored = line.result or {}
    response = {key: stored.get(key) for key in ("status_code", "request_id", "body")}
    return {**entry, "response": response, "error": None}


@dataclass(slots=True)
class OpenAIFiles:
    """A finished OpenAI batch's output file (succeeded lines), error file (the rest) and
    usage summed over the succeeded lines."""

    output: list[bytes] = field(default_factory=list)
    errors: list[bytes] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=lambda: empty_usage())

    def add(self, line: LineRecord) -> None:
        encoded = orjson.dumps(openai_line(line)) + b"\n"
        if line.state == SUCCEEDED:
            self.output.append(encoded)
            _add_usage(self.usage, (line.result or {}).get("body") or {})
        else:
            self.errors.append(encoded)

    def files(self, batch: BatchRecord) -> dict[str, NewFile | None]:
        def new(kind: str, lines: list[bytes]) -> NewFile | None:
            return NewFile(f"{batch.id}_{kind}.jsonl", b"".join(lines)) if lines else None

        return {"output": new("output", self.output), "error": new("error", self.errors)}


def openai_files(pages: Iterator[list[LineRecord]]) -> OpenAIFiles:
    files = OpenAIFiles()
    for page in pages:
        for line in page:
            files.add(line)
    return files


def empty_usage() -> dict[str, Any]:
    return {
        "input_tokens": 0,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 0,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 0,
    }


def _add_usage(total: dict[str, Any], body: dict[str, Any]) -> None:
    usage = body.get("usage") or {}
    prompt, completion = usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    total["input_tokens"] += prompt
    total["input_tokens_details"]["cached_tokens"] += cached
    total["output_tokens"] += completion
    total["output_tokens_details"]["reasoning_tokens"] += reasoning
    total["total_tokens"] += prompt + completion


def end_batch(store: Any, batch: BatchRecord) -> bool:
    """End a batch with nothing left to run (`store.finish_batch`), an OpenAI one with its
    output and error files and usage; False while lines are open."""
    if batch.api == "anthropic":
        return store.finish_batch(batch.id) is not None
    if store.counts(batch.id).processing:
        return False
    files = openai_files(store.line_pages(batch.id))
    made = files.files(batch)
    ended = store.finish_batch(
        batch.id, output=made["output"], error=made["error"], usage=files.usage
    )
    return ended is not None
