"""The Anthropic renderings: a MessageBatch, a list page, and a results line."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from zerohop.batches.records import (
    CANCELED,
    ENDED,
    ERRORED,
    EXPIRED,
    SUCCEEDED,
    BatchRecord,
    LineRecord,
    Page,
    RequestCounts,
)


def rfc3339(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


def message_batch(
    batch: BatchRecord, counts: RequestCounts, results_url: str | None
) -> dict[str, Any]:
    ended = batch.status == ENDED
    return {
        "id": batch.id,
        "type": "message_batch",
        "processing_status": batch.status,  # in_progress | canceling | ended, as the API's
        "request_counts": _counts(counts, ended),
        "created_at": rfc3339(batch.created_at),
        "expires_at": rfc3339(batch.expires_at),
        "ended_at": rfc3339(batch.ended_at),
        "cancel_initiated_at": rfc3339(batch.cancel_initiated_at),
        "archived_at": rfc3339(batch.archived_at),
        "results_url": results_url if ended else None,
    }


def _counts(counts: RequestCounts, ended: bool) -> dict[str, int]:
    # As the API reference documents: every line is `processing` until the batch ends.
    if not ended:
        zero = dict.fromkeys((SUCCEEDED, ERRORED, CANCELED, EXPIRED), 0)
        return {"processing": counts.total, **zero}
    return {
        "processing": 0,
        SUCCEEDED: counts.succeeded,
        ERRORED: counts.errored,
        CANCELED: counts.canceled,
        EXPIRED: counts.expired,
    }


def page(page: Page, rendered: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "data": rendered,
        "has_more": page.has_more,
        "first_id": page.first_id,
        "last_id": page.last_id,
    }


def result_line(line: LineRecord) -> dict[str, Any]:
    result: dict[str, Any] = {"type": line.state}
    stored = line.result or {}
    if line.state == SUCCEEDED:
        result["message"] = stored.get("body")
    elif line.state == ERRORED:
        result["error"] = stored.get("body")
    return {"custom_id": line.custom_id, "result": result}
