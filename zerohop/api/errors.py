"""API errors and their two wire shapes (Anthropic and OpenAI)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

# HTTP status -> Anthropic error type (https://docs.anthropic.com/en/api/errors).
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
# HTTP status -> OpenAI error type.
OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_exceeded",
    431: "invalid_request_error",
    500: "server_error",
    503: "server_error",
    529: "server_error",
}


class ErrorKind(StrEnum):
    """Why a request failed, the same on every surface: the audit record's `error_type`, the
    metrics' label and the console's. (A gateway refusal names its own reason instead:
    rate_limit_requests, budget, ...: `GatewayError.reason`.)"""

    INVALID_REQUEST = "invalid_request"  # the request's fault (4xx)
    RATE_LIMITED = "rate_limited"
    OVERLOADED = "overloaded"  # refused at admission: the replica is full
    TIMEOUT = "timeout"
    INTERNAL = "internal"  # the server's fault (5xx): an engine error, a bug
    UNAVAILABLE = "unavailable"  # draining, or the engine is restarting
    ENGINE_DEAD = "engine_dead"  # the engine died while serving the request
    SERVER_CANCELLED = "server_cancelled"  # the server aborted it (a drain, shedding)
    CLIENT_DISCONNECTED = "client_disconnected"  # the client went away (recorded as 499)


@dataclass(slots=True)
class ApiError(Exception):
    status: int
    message: str
    param: str | None = None  # OpenAI's `param`, when one field is at fault
    code: str | None = None  # OpenAI's `code`
    headers: list[tuple[bytes, bytes]] | None = None  # retry-after, x-should-retry
    # Anthropic's `error.details` (its `error_code` picks the SDK's exception class).
    details: dict[str, Any] | None = None
    kind: ErrorKind | None = None  # the audit record's error_type; None: by status

    def __str__(self) -> str:
        return self.message


# An error's kind by status where the raiser named none.
KINDS_BY_STATUS = {
    408: ErrorKind.TIMEOUT,
    429: ErrorKind.RATE_LIMITED,
    503: ErrorKind.OVERLOADED,
    529: ErrorKind.OVERLOADED,
}


def server_cancelled(status: int) -> ApiError:
    """An abort that was not the client's (the server drains, or sheds the request), with the
    API's overload status: Anthropic 529, OpenAI 503 (gRPC: UNAVAILABLE)."""
    message = "the server cancelled this request (shutting down or overloaded)"
    return ApiError(status, message, kind=ErrorKind.SERVER_CANCELLED)


def error_kind(error: ApiError) -> ErrorKind:
    if error.kind is not None:
        return error.kind
    if error.status in KINDS_BY_STATUS:
        return KINDS_BY_STATUS[error.status]
    return ErrorKind.INVALID_REQUEST if error.status < 500 else ErrorKind.INTERNAL


def anthropic_body(error: ApiError, request_id: str) -> dict[str, Any]:
    kind = ANTHROPIC_TYPES.get(error.status, "api_error")
    if error.code == "insufficient_quota":  # a spent budget: Claude Code stops, not retries
        kind = "billing_error"
    inner: dict[str, Any] = {"type": kind, "message": error.message}
    if error.details is not None:
        inner["details"] = error.details
    return {"type": "error", "error": inner, "request_id": request_id}


def openai_body(error: ApiError, request_id: str) -> dict[str, Any]:
    kind = OPENAI_TYPES.get(error.status, "server_error")
    if error.code == "insufficient_quota":  # OpenAI's type for a spent quota (not retried)
        kind = "insufficient_quota"
    return {
        "error": {
            "message": error.message,
            "type": kind,
            "param": error.param,
            "code": error.code,
        }
    }
