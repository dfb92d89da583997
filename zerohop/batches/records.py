"""The store's vocabulary: line and batch states, the errors it raises, and its records."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Api = Literal["anthropic", "openai"]
APIS: tuple[Api, ...] = ("anthropic", "openai")

WAITING, RUNNING = "waiting", "running"
SUCCEEDED, ERRORED, CANCELED, EXPIRED = "succeeded", "errored", "canceled", "expired"
FINISHED = (SUCCEEDED, ERRORED, CANCELED, EXPIRED)
LINE_STATES = (WAITING, RUNNING, *FINISHED)

# A batch's status in the store; each API maps it to its own words (Anthropic's
# processing_status, OpenAI's status) with the timestamps beside it.
IN_PROGRESS, CANCELING, ENDED, FAILED = "in_progress", "canceling", "ended", "failed"
OPEN = (IN_PROGRESS, CANCELING)  # lines may still run

DAY = 24 * 3600.0
# Runs a line may begin: one abandoned this often (the server died while running it each
# time) is errored rather than started again.
MAX_LINE_ATTEMPTS = 3


class StoreError(Exception):
    """A change the store refuses (the API answers it as a 400 or 404)."""


class DuplicateCustomId(StoreError):
    def __init__(self, custom_id: str) -> None:
        super().__init__(f"custom_id {custom_id!r} is used by more than one request")
        self.custom_id = custom_id


class BatchNotEnded(StoreError):
    """A batch is deleted only once it has ended (cancel it first)."""


class UnknownCursor(StoreError):
    """A pagination cursor that names no object of this tenant."""


# -- records ---------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class FileRecord:
    id: str
    tenant: str
    purpose: str
    filename: str
    bytes: int
    created_at: float
    expires_at: float | None
    path: Path


@dataclass(slots=True, frozen=True)
class NewFile:
    """A file's content and name, to be stored (an upload, a batch's output)."""

    filename: str
    content: bytes
    purpose: str = "batch_output"


@dataclass(slots=True)
class NewBatch:
    tenant: str
    key_id: str
    api: Api
    endpoint: str  # "/v1/messages", "/v1/chat/completions" or "/v1/completions"
    model: str | None = None
    completion_window: str | None = None  # OpenAI's "24h"
    input_file_id: str | None = None
    metadata: dict[str, Any] | None = None
    identity: dict[str, Any] | None = None  # the caller as the runner serves its lines
    errors: list[dict[str, Any]] | None = None  # OpenAI validation errors: the batch failed
    expires_in: float = DAY
    created_at: float | None = None  # None: now


@dataclass(slots=True, frozen=True)
class NewLine:
    """One request of a new batch. `params` is the request body (JSON text, or a value to
    encode); a line refused at creation (another model, bad params) comes finished, with
    its `state` and `result`."""

    custom_id: str
    params: Any
    state: str = WAITING
    result: Any = None


@dataclass(slots=True, frozen=True)
class BatchRecord:
    id: str
    tenant: str
    key_id: str
    api: Api
    endpoint: str
    model: str | None
    status: str
    created_at: float
    expires_at: float
    ended_at: float | None
    cancel_initiated_at: float | None
    expired_at: float | None
    archived_at: float | None
    completion_window: str | None
    input_file_id: str | None
    output_file_id: str | None
    error_file_id: str | None
    metadata: dict[str, Any] | None
    errors: list[dict[str, Any]] | None
    usage: dict[str, Any] | None
    identity: dict[str, Any] | None

    @property
    def open(self) -> bool:
        return self.status in OPEN


@dataclass(slots=True, frozen=True)
class LineRecord:
    batch_id: str
    index: int
    custom_id: str
    params: str  # the request body, as JSON text
    state: str
    result: Any  # decoded JSON; None until finished (or for canceled/expired lines)
    attempts: int  # times a runner started it (a crash's run included)


@dataclass(slots=True, frozen=True)
class WaitingLine:
    """A line for a runner: with its batch's tenant, key and endpoint."""

    line: LineRecord
    tenant: str
    key_id: str
    endpoint: str
    identity: dict[str, Any] | None = None  # a signed key's snapshot (its batch's `identity`)


@dataclass(slots=True)
class RequestCounts:
    waiting: int = 0
    running: int = 0
    succeeded: int = 0
    errored: int = 0
    canceled: int = 0
    expired: int = 0

    @property
    def processing(self) -> int:
        return self.waiting + self.running

    @property
    def total(self) -> int:
        return self.processing + self.finished

    @property
    def finished(self) -> int:
        return self.succeeded + self.errored + self.canceled + self.expired


@dataclass(slots=True)
class Page:
    """One page of a list, newest first unless asked otherwise; ids for the next cursor."""

    data: list[Any] = field(default_factory=list)
    has_more: bool = False

    @property
    def first_id(self) -> str | None:
        return self.data[0].id if self.data else None

    @property
    def last_id(self) -> str | None:
        return self.data[-1].id if self.data else None
