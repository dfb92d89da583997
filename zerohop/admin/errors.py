"""The admin API's refusals: `AdminError` (status, Anthropic's error type, message), and the
helpers the views and the service answer a bad value with. Imports nothing of admin, so the
service and the context both stand on it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from zerohop.gateway.keys.identity import KeyRef

T = TypeVar("T")


class AdminError(Exception):
    """An admin request refused: HTTP `status`, Anthropic's error `type`, a message. One
    refused for who sent it has a `reason` and the `key` presented, when known: it is
    audited (`zerohop.admin.refusal_audit`)."""

    def __init__(
        self, status: int, kind: str, message: str, *, reason: str | None = None,
        key: KeyRef | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message
        self.reason, self.key = reason, key


def not_found(message: str) -> AdminError:
    return AdminError(404, "not_found_error", message)


def invalid(message: str) -> AdminError:
    return AdminError(400, "invalid_request_error", message)


def checked(check: Callable[..., T], *args: Any) -> T:
    """`check(*args)`, its ValueError (a value the caller sent) answered as a 400."""
    try:
        return check(*args)
    except ValueError as exc:
        raise invalid(str(exc)) from None
