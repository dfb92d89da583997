"""API errors and their two wire shapes (Anthropic and OpenAI)."""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(slots=True)
class ApiError(Exception):
    status: int
    message: str
    param: str | None = None  # OpenAI's `param`, when one field is at fault
    code: str | None = None  # OpenAI's `code`
    headers: list[tuple[bytes, bytes]] | None = None  # retry-after, x-should-retry
    # Anthropic's `error.details` (its `error_code` picks the SDK's exception class).
    details: dict[str, Any] | None = None
    kind: str | None = None  # the audit record's error_type; None: by status (error_kind)

    def __str__(self) -> str:
        return self.message


# An error's kind by status where the raiser named none: the audit record's `error_type` and
# the console's, the same on every surface. (A gateway refusal names its reason instead:
# rate_limit_requests, budget, ...; a client gone is client_disconnected.)
KINDS_BY_STATUS = {408: "timeout", 429: "rate_limited", 503: "overloaded", 529: "overloaded"}


def server_cancelled(status: int) -> ApiError:
    """An abort that was not the client's (the server drains, or sheds the request), with the
    API's overload status: Anthropic 529, OpenAI 503 (gRPC: UNAVAILABLE)."""
    message = "the server cancelled this request (shutting down or overloaded)"
    return ApiError(status, message, kind="server_cancelled")


def error_kind(error: ApiError) -> str:
    if error.kind is not None:
        return error.kind
    if error.status in KINDS_BY_STATUS:
        return KINDS_BY_STATUS[error.status]
    return "invalid_request" if error.status < 500 else "internal"


def anthropic_body(error: ApiError, request_id: str) -> dict:
    kind = ANTHROPIC_TYPES.get(error.status, "api_error")
    inner: dict[str, Any] = {"type": kind, "message": error.message}
    if error.details is not None:
        inner["details"] = error.details
    return {"type": "error", "error": inner, "request_id": request_id}


def openai_body(error: ApiError, request_id: str) -> dict:
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
