"""The OpenAI renderings: a FileObject, a Batch (its status mapped from the store's), and the
list pages of both. Times are integer Unix seconds, as the API's."""

from __future__ import annotations

from typing import Any

from zerohop.batches.records import (
    CANCELING,
    ENDED,
    FAILED,
    BatchRecord,
    FileRecord,
    Page,
    RequestCounts,
)
from zerohop.batches.results import empty_usage


def unix(seconds: float | None) -> int | None:
    return None if seconds is None else int(seconds)


def file_object(record: FileRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "object": "file",
        "bytes": record.bytes,
        "created_at": int(record.created_at),
        "filename": record.filename,
        "purpose": record.purpose,
        "status": "processed",
        "expires_at": unix(record.expires_at),
        "status_details": None,
    }


def batch_object(batch: BatchRecord, counts: RequestCounts) -> dict[str, Any]:
    status, times = _status(batch, counts)
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "model": batch.model,
        "errors": {"object": "list", "data": batch.errors} if batch.errors else None,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window or "24h",
        "status": status,
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        "created_at": int(batch.created_at),
        "expires_at": unix(batch.expires_at),
        **times,
        "request_counts": {
            "total": counts.total,
            "completed": counts.succeeded,
            "failed": counts.errored + counts.canceled + counts.expired,
        },
        "metadata": batch.metadata,
        "usage": batch.usage or empty_usage(),
    }


_TIMES = (
    "in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
    "cancelling_at", "cancelled_at",
)  # fmt: skip


def _status(batch: BatchRecord, counts: RequestCounts) -> tuple[str, dict[str, int | None]]:
    """OpenAI's status and its timestamps, from the store's status and times."""
    times: dict[str, int | None] = dict.fromkeys(_TIMES)
    ended, cancel = unix(batch.ended_at), unix(batch.cancel_initiated_at)
    if batch.status == FAILED:
        times["failed_at"] = ended
        return "failed", times
    times["in_progress_at"] = int(batch.created_at)
    times["cancelling_at"] = cancel
    if batch.status == CANCELING:
        return "cancelling", times
    if batch.status != ENDED:
        return ("finalizing" if counts.processing == 0 else "in_progress"), times
    if cancel is not None:
        times["cancelled_at"] = ended
        return "cancelled", times
    times["finalizing_at"] = ended
    if batch.expired_at is not None:
        times["expired_at"] = unix(batch.expired_at)
        return "expired", times
    times["completed_at"] = ended
    return "completed", times


def list_page(page: Page, rendered: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "object": "list",
        "data": rendered,
        "first_id": page.first_id,
        "last_id": page.last_id,
        "has_more": page.has_more,
    }
