"""Input items as the API lists them: each with an `id` (given one when the request's item
had none) and a `type`, a message's string content as one text part, a message, call or
call output `status` "completed" when it came without one; and
`GET /v1/responses/{id}/input_items` pages (`limit` 1 to 100, default 20; `order` "desc",
the default, newest first, or "asc"; `after` an item id)."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs

from zerohop.api.errors import ApiError
from zerohop.api.responses.output import new_id

_PREFIX = {
    "message": "msg_",
    "function_call": "fc_",
    "custom_tool_call": "ctc_",
    "reasoning": "rs_",
}
_WITH_STATUS = ("message", "function_call", "function_call_output")


def with_ids(items: list[Any]) -> list[Any]:
    """The items, each object one with its `type` and an `id` (kept when it had one)."""
    listed = []
    for item in items:
        if isinstance(item, dict):
            kind = item.get("type", "message" if "role" in item else None)
            if kind is not None and "id" not in item:
                item = {"id": new_id(_PREFIX.get(kind, "item_")), **item, "type": kind}
            elif kind is not None:
                item = {**item, "type": kind}
            if kind in _WITH_STATUS and "status" not in item:
                item = {**item, "status": "completed"}
            if kind == "message" and isinstance(item.get("content"), str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": item["content"]}]
        listed.append(item)
    return listed


def input_items_page(items: list[Any], query: bytes) -> dict[str, Any]:
    params = {k: v[-1] for k, v in parse_qs(query.decode("latin-1")).items()}
    limit = _limit(params.get("limit", "20"))
    order = params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, "order: must be 'asc' or 'desc'", param="order")
    ordered = [i for i in items if isinstance(i, dict)]
    if order == "desc":
        ordered.reverse()
    after = params.get("after")
    if after is not None:
        ids = [i.get("id") for i in ordered]
        ordered = ordered[ids.index(after) + 1 :] if after in ids else []
    page = ordered[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0].get("id") if page else None,
        "last_id": page[-1].get("id") if page else None,
        "has_more": len(ordered) > limit,
    }


def _limit(given: str) -> int:
    try:
        limit = int(given)
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise ApiError(400, "limit: must be an integer between 1 and 100", param="limit")
    return limit
