"""Compaction on the Messages API, done by the served model (api/compaction/).

- The `compact_20260112` edit (anthropic/context.py decides when its trigger is exceeded):
  the conversation is summarized, the request goes on with the summary in place of its
  messages (as a later request carrying the block would), and the response's content opens
  with the `compaction` block, signed, before the answer; `applied_edits` names it.
  With `pause_after_compaction`, or on a stream, the response is the block alone with
  `stop_reason` "compaction" (the client sends it back to go on): a stream's events are
  written as they come and the block must lead them.
- The explicit request (`compaction: {"type": "summarize"}`, beta compact-2026-09-04): the
  response is the block alone (`stop_reason` "compaction"), streamed or not; `instructions`
  replace the summarization prompt. Combined with `context_management` it is a 400, as
  documented.
- Usage, as documented: `usage.iterations` lists the compaction's own tokens (an entry of
  type "compaction") before the answer's (type "message"); the top-level fields are the
  answer's only, so a response that is the block alone has zeros there. The request's
  audit record and charges count both (api/compaction/summarize.py).
- A summary the model left empty is a failed compaction: the block's `content` is null
  (a no-op when sent back) and no signature is given.
"""

from __future__ import annotations

from typing import Any

import msgspec
import orjson

from zerohop.api.anthropic.blocks import sse_event
from zerohop.api.anthropic.message_encoder import usage_body
from zerohop.api.anthropic.schema import CompactionBlock, Message, MessagesRequest
from zerohop.api.compaction.seal import Sealer
from zerohop.api.compaction.summarize import Summary
from zerohop.api.errors import ApiError
from zerohop.api.generation.events import Usage
from zerohop.api.http.asgi import Send, end_stream, request_id_headers, send_json, start_stream


def check(request: MessagesRequest) -> None:
    """The explicit compaction request's documented refusal."""
    if request.compaction is not None and request.context_management is not None:
        raise ApiError(
            400,
            "compaction: cannot be combined with context_management",
            param="compaction",
        )


def block(summary: Summary, sealer: Sealer) -> dict[str, Any]:
    text = summary.text or None
    signature = sealer.sign(text) if text else None
    return {"type": "compaction", "content": text, "signature": signature}


def compacted(request: MessagesRequest, made: dict[str, Any]) -> MessagesRequest:
    """The request going on after its compaction: the block in place of its messages."""
    if made["content"] is None:
        return request
    carried = CompactionBlock(content=made["content"], signature=made["signature"])
    return msgspec.structs.replace(request, messages=[Message("assistant", [carried])])


def applied(summary: Summary) -> dict[str, Any]:
    return {"type": "compact_20260112", "compacted_input_tokens": summary.usage.prompt_tokens}


def compaction_usage(summary: Summary) -> dict[str, Any]:
    """The compaction's entry in `usage.iterations`."""
    return {"type": "compaction", **usage_body(summary.usage)}


async def send_block_only(
    send: Send,
    request: MessagesRequest,
    request_id: str,
    made: dict[str, Any],
    summary: Summary,
    context: dict[str, Any] | None,
) -> None:
    """The response that is the compaction block alone (`stop_reason` "compaction")."""
    head: dict[str, Any] = {
        "id": "msg_" + request_id.removeprefix("req_"),
        "type": "message",
        "role": "assistant",
        "model": request.model,
    }
    usage: dict[str, Any] = {**usage_body(Usage(0)), "iterations": [compaction_usage(summary)]}
    headers = request_id_headers(request_id)
    if not request.stream:
        body: dict[str, Any] = {
            **head,
            "content": [made],
            "stop_reason": "compaction",
            "stop_sequence": None,
        }
        body["usage"] = usage
        if context is not None:
            body["context_management"] = context
        return await send_json(send, 200, body, headers)
    start: dict[str, Any] = {
        **head,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }
    opened = {**made, "content": None}
    delta: dict[str, Any] = {"stop_reason": "compaction", "stop_sequence": None}
    end: dict[str, Any] = {"delta": delta, "usage": usage}
    if context is not None:
        end["context_management"] = context
    await start_stream(send, headers)
    await end_stream(
        send,
        sse_event("message_start", {"message": start})
        + sse_event("content_block_start", {"index": 0, "content_block": opened})
        + sse_event(
            "content_block_delta",
            {"index": 0, "delta": {"type": "compaction_delta", "content": made["content"]}},
        )
        + sse_event("content_block_stop", {"index": 0})
        + sse_event("message_delta", end)
        + sse_event("message_stop", {}),
    )


def leading(send: Send, made: dict[str, Any], done: dict[str, Any], summary: Summary) -> Send:
    """`send` for a whole (not streamed) answer after a compaction: its content opens with
    the block `made`, its `applied_edits` name the compaction (`done`), and its
    `usage.iterations` the summary's tokens before the answer's."""
    held: list[Any] = []

    async def wrapped(message: Any) -> None:
        if message["type"] == "http.response.start" and message["status"] == 200:
            held.append(message)
            return
        if not held or message["type"] != "http.response.body":
            return await send(message)
        start = held.pop()
        body = orjson.loads(message["body"])
        body["content"].insert(0, made)
        context = body.setdefault("context_management", {"applied_edits": []})
        context["applied_edits"].append(done)
        usage = body["usage"]
        answer = {"type": "message", **{k: v for k, v in usage.items() if k != "iterations"}}
        usage["iterations"] = [compaction_usage(summary), answer]
        payload = orjson.dumps(body)
        headers = [(k, v) for k, v in start["headers"] if k != b"content-length"]
        headers.append((b"content-length", str(len(payload)).encode()))
        await send({**start, "headers": headers})
        await send({**message, "body": payload})

    return wrapped
