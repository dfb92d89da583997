"""What the audit writer does while its directory cannot be written (disk error, full disk).

`--audit-failure open` (the default) keeps serving: records that cannot be written are kept
in memory, at most `max_pending` of them (the oldest; newer ones are lost and counted), and
retried at every flush; once a write succeeds again, a marker record saying how many were
lost is written into the chain first. `closed` does the same with the records, and while
the last write failed, refuses every new request with a 503 (`Gateway.admit`), so that no
request is served that may not be audited; it serves again after the next write succeeds.
`/health` answers 200 either way: the process is alive and serves what it may.

Open is the default because the audit record is written after a request ends, off the
request path, like an access log: an operator expects a full log disk to degrade the
record keeping, visibly (`zerohop_audit_*` in `/metrics`, one log line per interval), not to
take the inference service down. Deployments where no request may go unaudited choose
`closed`.
"""

from __future__ import annotations

import logging
import time
from typing import Literal

from zerohop.gateway.audit.record import AuditRecord

log = logging.getLogger("zerohop.gateway.audit.log")

FailureMode = Literal["open", "closed"]
FAILURE_MODES: tuple[FailureMode, ...] = ("open", "closed")
DEFAULT_MAX_PENDING = 10_000


class AuditFailures:
    """The writer's failure state and counters; touched by the writer thread only (the
    counters are read by /metrics, a stale read is fine)."""

    def __init__(
        self, mode: FailureMode = "open", max_pending: int = DEFAULT_MAX_PENDING,
        log_interval: float = 10.0,
    ) -> None:  # fmt: skip
        if mode not in FAILURE_MODES:
            raise ValueError(f"audit failure mode must be one of {', '.join(FAILURE_MODES)}")
        if max_pending < 1:
            raise ValueError("max_pending must be at least 1")
        self.mode = mode
        self.max_pending = max_pending
        self.log_interval = log_interval
        self.failing = False
        self.write_errors = 0
        self.lost = 0  # records that will never be written
        self.pending = 0  # records kept for retry
        self._unmarked = 0  # lost records no marker record written has told yet
        self._marker: AuditRecord | None = None  # the marker record now being written, if any
        self._logged_at = float("-inf")

    @property
    def refusing(self) -> bool:
        """Closed mode, and the last write failed: new requests are refused."""
        return self.mode == "closed" and self.failing

    def failed(self, exc: BaseException, pending: list[AuditRecord]) -> list[AuditRecord]:
        """A write failed: return the records to retry (the oldest max_pending)."""
        self.write_errors += 1
        pending = self._unmark(pending)
        kept = pending[: self.max_pending]
        self._lose(len(pending) - len(kept))
        self.pending = len(kept)
        now = time.monotonic()
        if not self.failing or now - self._logged_at >= self.log_interval:
            log.error(
                "audit: cannot write the log (%s): %d records pending, %d lost so far;"
                " serving %s (--audit-failure %s)",
                _one_line(exc), self.pending, self.lost,
                "goes on" if self.mode == "open" else "is refused", self.mode,
            )  # fmt: skip
            self._logged_at = now
        self.failing = True
        return kept

    def succeeded(self) -> None:
        self._marker = None
        if self.failing:
            log.warning("audit: writing again; %d records were lost", self.lost)
        self.failing, self.pending = False, 0

    def closing_with(self, pending: int) -> None:
        """close() gives up on `pending` records."""
        if pending:
            self._lose(pending)
            log.error("audit: %d records could not be written", pending)

    def take_marker(self) -> AuditRecord | None:
        """A record telling of the records lost since the last marker, or None."""
        if not self._unmarked:
            return None
        lost, self._unmarked = self._unmarked, 0
        message = f"{lost} audit records were lost: the audit directory could not be written"
        self._marker = {"time": time.time(), "audit_error": message, "audit_lost": lost}
        return self._marker

    def _unmark(self, pending: list[AuditRecord]) -> list[AuditRecord]:
        """A marker that was not written is no record to keep: its count waits for the next."""
        marker, self._marker = self._marker, None
        if marker is None or not any(entry is marker for entry in pending):
            return pending
        self._unmarked += marker["audit_lost"]
        return [entry for entry in pending if entry is not marker]

    def _lose(self, n: int) -> None:
        self.lost += n
        self._unmarked += n


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
