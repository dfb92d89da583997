"""The client's side of OpenAI `POST /v1/responses` (surface_base.py: what every API shares)."""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from zerohop.client.surface_base import (
    Surface,
    UpstreamFailed,
    cached_within,
    event_data,
    list_of,
    opening,
    sse_event,
    text_of,
)


class Responses(Surface):
    """OpenAI `POST /v1/responses`. Its affinity key is `prompt_cache_key` when the request
    has one (Codex sends its session's id: every turn of a session goes to one replica),
    else the conversation's opening. A stream resumes as the others do: the continuing
    replica builds the continued items without events and goes on in the open one; its
    `response.created` / `in_progress` and the item it reopens are dropped here, and its
    events renamed to the first replica's ids (response, items, calls) and numbered on from
    the caller's last `sequence_number`. A replica that fails once the caller has all
    `max_output_tokens` leaves nothing to continue: `finish` ends the stream with the
    response as the caller has it (its items; its usage: the input's, which a replica's
    `response.created` carries under `return_token_ids`, and the output tokens).

    The caller keeps the first replica's response id, so a continuation asks the continuing
    replica to store the response under it (`continue_response_id`, the zerohop extension
    that goes with `continue_token_ids`: an empty list restarts an answer that had no token
    yet): a later `previous_response_id` or `GET /v1/responses/{id}` with the caller's id
    finds it (pinning.py learns that id's new replica from the continuation's
    `response.created`). A `response.failed` whose error is the server's (`server_error`:
    its engine died, it drained) fails over as an error event does on the other APIs; a
    client error (`invalid_prompt`, `rate_limit_exceeded`) and `response.incomplete` reach
    the caller."""

    ENDS = ("response.completed", "response.incomplete", "response.failed")
    PREAMBLE = ("response.created", "response.in_progress")

    def __init__(self, payload: dict[str, Any]) -> None:
        super().__init__(payload)
        self.sequence = 0  # the next event's number, as the caller sees it
        self.response: dict[str, Any] = {}  # the first replica's response object
        self.ids: list[tuple[str, str | None]] = []  # each item's id and call_id, by index
        self.reopened = 0  # the items the caller has when the current replica took over
        self.items: list[dict[str, Any]] = []  # each item as the caller last saw it
        self.closed = 0  # of them, those whose output_item.done the caller has (in order)
        self.input_usage: dict[str, Any] = {}  # response.created's (with return_token_ids)

    def affinity_text(self) -> str:
        key = self.payload.get("prompt_cache_key")
        if isinstance(key, str) and key:  # hashed: under one affinity block, never cut
            return "prompt_cache_key:" + hashlib.sha256(key.encode()).hexdigest()[:40]
        given = self.payload.get("input")
        items = (
            [{"role": "user", "content": given}]
            if isinstance(given, str)
            else list_of(self.payload, "input")
        )
        return opening(text_of(self.payload.get("instructions") or ""), items)

    def limit_field(self) -> str | None:
        return "max_output_tokens" if self.payload.get("max_output_tokens") else None

    def continuation(self) -> dict[str, Any] | None:
        self.reopened = len(self.ids)
        body = super().continuation()
        if body is None or not self.started:
            return body
        ids = {"continue_token_ids": self.token_ids, "continue_response_id": self.response["id"]}
        return {**body, **ids}

    def feed(self, event: bytes) -> bytes:
        data = event_data(event)
        if data is None:
            return event
        message = orjson.loads(data)
        kind = message.get("type")
        if kind == "response.failed" and _server_failed(message):
            raise UpstreamFailed(message["response"]["error"].get("message", "response.failed"))
        if kind == "error" or kind in self.ENDS:
            self.done = True
        self.token_ids.extend(message.get("token_ids") or ())
        usage = message.get("usage")  # response.created's (return_token_ids), else None
        if not self.payload.get("return_token_ids"):
            message.pop("token_ids", None)
            message.pop("usage", None)
        if kind in self.PREAMBLE and self.resumed:
            return b""
        if kind == "response.created":
            self.started = True
            self.response = dict(message["response"])
            self.input_usage = usage or {}
        self.delivered |= isinstance(kind, str) and kind.endswith(".delta")
        if kind == "response.output_item.added":
            index = message["output_index"]
            if self.resumed and index < self.reopened:
                return b""  # the item the caller has open, reopened by the continuation
            item = message["item"]
            self.ids[index:] = [(item["id"], item.get("call_id"))]
        if self.resumed:
            self._rename(message)
        if kind in ("response.output_item.added", "response.output_item.done"):
            self._keep(message["output_index"], message["item"], kind.endswith(".done"))
        if "sequence_number" in message:
            message["sequence_number"] = self.sequence
            self.sequence += 1
        return sse_event(str(kind), message)

    def _rename(self, message: dict[str, Any]) -> None:
        """The continuing replica's ids made the first's, its usage counted once."""
        index = message.get("output_index")
        if isinstance(index, int) and index < len(self.ids):
            item_id, call_id = self.ids[index]
            if "item_id" in message:
                message["item_id"] = item_id
            if isinstance(message.get("item"), dict):
                message["item"] = _renamed(message["item"], item_id, call_id)
        response = message.get("response")
        if isinstance(response, dict):
            output = [
                _renamed(item, *self.ids[i]) if i < len(self.ids) else item
                for i, item in enumerate(response.get("output") or [])
            ]
            head = {k: self.response[k] for k in ("id", "created_at") if k in self.response}
            message["response"] = {**response, **head, "output": output}
            if response.get("usage"):
                message["response"]["usage"] = self._usage(response["usage"])

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        # The continuing replica counted the continued tokens as input (and its prefix cache
        # held them); it counted their thought as reasoning tokens already.
        given = usage["input_tokens"] - self.base
        counted = {
            **usage,
            "input_tokens": given,
            "output_tokens": usage["output_tokens"] + self.base,
        }
        return cached_within(counted, "input_tokens_details", given)

    def _keep(self, index: int, item: dict[str, Any], done: bool) -> None:
        self.items[index:] = [item]
        self.closed = index + 1 if done else index

    def finish(self) -> bytes:
        """The response as the caller has it: its items (one still open: `incomplete`), and
        usage from the input's (response.created's) and the output tokens it has."""
        output = [
            item if i < self.closed or "status" not in item else {**item, "status": "incomplete"}
            for i, item in enumerate(self.items)
        ]
        response = {**self.response, "status": "incomplete", "output": output}
        response["incomplete_details"] = {"reason": "max_output_tokens"}
        if self.input_usage:
            tokens, usage = len(self.token_ids), self.input_usage
            total = usage["input_tokens"] + tokens
            response["usage"] = {**usage, "output_tokens": tokens, "total_tokens": total}
        event = {"response": response, "sequence_number": self.sequence}
        return sse_event("response.incomplete", event)

    def error_event(self, message: str) -> bytes:
        event = {"code": "overloaded", "message": message, "param": None}
        return sse_event("error", {**event, "sequence_number": self.sequence})


def _renamed(item: dict[str, Any], item_id: str, call_id: str | None) -> dict[str, Any]:
    item = {**item, "id": item_id}
    return item if call_id is None or "call_id" not in item else {**item, "call_id": call_id}


def _server_failed(message: dict[str, Any]) -> bool:
    """Whether a `response.failed` event is the server's failure, not the request's."""
    response = message.get("response")
    error = response.get("error") if isinstance(response, dict) else None
    return isinstance(error, dict) and error.get("code") == "server_error"
