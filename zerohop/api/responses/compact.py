"""Compaction on the Responses API (api/compaction/ does the summary and its seal).

- `POST /v1/responses/compact` (Codex's remote compaction, the SDK's `responses.compact`)
  takes a create request's `model`, `input`, `instructions` and `previous_response_id` and
  answers a `response.compaction` object whose `output` is the input's user messages, as
  sent (each an output `message` item: its `id`, or a new one, and status "completed"),
  followed by one `compaction` item: its `encrypted_content` is the model's summary of
  the whole conversation, sealed for the caller's tenant. Earlier compaction items are
  summarized with the rest and are not repeated.
- A later request that carries a `compaction` item gets the summary in its prompt where the
  item is (a user-side note); one that does not verify is a 400 naming the item.
- `context_management: [{"type": "compaction", "compact_threshold": N}]` on create: when the
  prompt exceeds N tokens, the input is compacted first (as above) and the response is
  generated on the compacted input; the compaction item leads the response's `output`, so
  the next turn (by `previous_response_id` or by sending the output back) carries it.
  Streamed, the item is sent (output_item.added and .done) before the answer's items.
- A create whose input ends with a `compaction_trigger` item (Codex's remote compaction: its
  request as for a turn, with that item last) is answered with the compaction item as the
  whole `output`, its usage the summary's; no answer is generated. Anywhere else in the
  input, the item is a 400 (it must be the final input item).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from zerohop.api.compaction.seal import Sealer, sealer, signature_of
from zerohop.api.compaction.summarize import Summary, framed, summarize
from zerohop.api.conversation.request import Conversation
from zerohop.api.errors import ApiError
from zerohop.api.responses.output import new_id
from zerohop.api.serving.service import ServingContext
from zerohop.gateway.gateway import Call

COMPACTION = "compaction"
TRIGGER = "compaction_trigger"


def triggered(items: list[Any]) -> tuple[list[Any], bool]:
    """The request's input items without a final `compaction_trigger`, and whether it had
    one; a trigger anywhere else is a 400."""
    at = [i for i, item in enumerate(items) if _type(item) == TRIGGER]
    if not at:
        return items, False
    if at != [len(items) - 1]:
        raise _invalid(f"input[{at[0]}]", "a compaction_trigger item must be the final input item")
    return items[:-1], True


def _type(item: Any) -> Any:
    return item.get("type") if isinstance(item, dict) else None


def charge(call: Call, summary: Summary) -> None:
    """A compaction-only request's record: its tokens are the summary's, which summarize
    added to the call (`Call.add_usage`); its stop reason is the compaction."""
    call.stop_reason = COMPACTION


def _compactions(items: list[Any]) -> list[Any]:
    return [
        item.get("encrypted_content")
        for item in items
        if isinstance(item, dict) and item.get("type") == COMPACTION
    ]


async def opened(ctx: ServingContext, call: Call, items: list[Any]) -> list[Any]:
    """The items with each compaction item replaced by its summary, as a user message."""
    blobs = _compactions(items)
    if not blobs:
        return items
    signatures = [s for b in blobs if isinstance(b, str) and (s := signature_of(b))]
    seals = await sealer(ctx, call.identity.tenant.name, signatures)
    return [_opened(item, i, seals) for i, item in enumerate(items)]


def _opened(item: Any, i: int, seals: Sealer) -> Any:
    if not isinstance(item, dict) or item.get("type") != COMPACTION:
        return item
    summary = seals.open(item.get("encrypted_content"), f"input[{i}].encrypted_content")
    return {"type": "message", "role": "user", "content": framed(summary)}


def threshold(context_management: Any) -> int | None:
    """The compaction threshold of a create's `context_management` (None: no compaction)."""
    if context_management is None:
        return None
    if not isinstance(context_management, list):
        raise _invalid("context_management", "must be a list of entries")
    found = None
    for i, entry in enumerate(context_management):
        kind = entry.get("type") if isinstance(entry, dict) else None
        if kind != COMPACTION:
            raise _invalid(f"context_management[{i}].type", "must be 'compaction'")
        value = entry.get("compact_threshold")
        if value is not None and (not isinstance(value, int) or value < 1):
            raise _invalid(
                f"context_management[{i}].compact_threshold", "must be a positive integer"
            )
        found = value if value is not None else found
    return found


async def compacted(
    ctx: ServingContext, call: Call, items: list[Any], conv: Conversation
) -> tuple[list[Any], Summary]:
    """The compacted item list of `items` (whose prompt is `conv`), and the summary."""
    summary = await summarize(ctx, call, conv, "responses")
    seals = await sealer(ctx, call.identity.tenant.name)
    item = {
        "id": "cmp_" + uuid.uuid4().hex,
        "type": COMPACTION,
        "encrypted_content": seals.seal(summary.text),
        "created_by": ctx.model_name,
    }
    return [*_user_messages(items), item], summary


def _user_messages(items: list[Any]) -> list[Any]:
    kept = []
    for item in items:
        if not isinstance(item, dict) or item.get("role") != "user":
            continue
        if item.get("type", "message") != "message":
            continue
        content = item.get("content")
        if isinstance(content, str):
            content = [{"type": "input_text", "text": content}]
        # An output item (the spec's Message): it has an id and a status, as the API's do.
        message_id = item.get("id") or new_id("msg_")
        message = {"id": message_id, "type": "message", "role": "user", "content": content}
        kept.append({**message, "status": "completed"})
    return kept


def compaction_body(call: Call, output: list[Any], summary: Summary) -> dict[str, Any]:
    """The `response.compaction` object."""
    usage = summary.usage
    return {
        "id": "resp_" + call.request_id.removeprefix("req_"),
        "object": "response.compaction",
        "created_at": int(time.time()),
        "output": output,
        "usage": {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.output_tokens,
        },
    }


def _invalid(name: str, problem: str) -> ApiError:
    return ApiError(400, f"Invalid value for '{name}': {problem}", param=name)
