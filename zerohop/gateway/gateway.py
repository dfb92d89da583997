"""The gateway as the API surfaces use it: authenticate, admit, charge per step, finish.

One `Call` per request carries who it is from and what it was charged; the surfaces know
nothing of buckets or ledgers, only of the errors raised here (each with its HTTP status,
headers and whether a client should retry) and the rate-limit facts for their headers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from zerohop.gateway.audit.record import AuditRecord
from zerohop.gateway.auth import (
    AuthenticationError,
    Authenticator,
    InvalidKeyConfiguration,
    PermissionDenied,
    check_model,
)
from zerohop.gateway.budget_view import refusal_retry_after
from zerohop.gateway.budgets.leased_ledger import LeaseUnavailable
from zerohop.gateway.budgets.ledger import Ledger
from zerohop.gateway.budgets.sqlite_ledger import (
    BudgetExhausted,
    BudgetLedger,
    LedgerUnavailable,
    Reservation,
)
from zerohop.gateway.budgets.sqlite_writer import Durability
from zerohop.gateway.fleet_options import LeaseOptions
from zerohop.gateway.keys.identity import ANONYMOUS, Identity, KeyRef
from zerohop.gateway.limits import buckets as limits
from zerohop.gateway.limits.buckets import RateLimiter, RateState, Refusal, SubjectLimits
from zerohop.gateway.limits.fleet_shares import FleetRates
from zerohop.gateway.store.key_snapshot import LocalCopy
from zerohop.gateway.store.spec import StoreSpec
from zerohop.gateway.store.store import Store
from zerohop.gateway.usage import UsageRecorder

if TYPE_CHECKING:  # the parts a Gateway is given: their modules load with their makers
    from zerohop.gateway.audit.log import AuditLog
    from zerohop.gateway.keys.signed_tokens import SignedKeyVerifier
    from zerohop.gateway.metrics import GatewayMetrics

# What requests without a token budget do while the ledger cannot be written: "open" serves
# them (the ledger records nothing for them), "closed" refuses them too.
LEDGER_FAILURE_POLICIES = ("open", "closed")
LEDGER_RETRY_AFTER = 1.0  # seconds: the ledger's writer tries the disk again every second


class LoadObserver(Protocol):
    """What sees each request's tokens and end (the console's live load)."""

    def on_tokens(self, tenant: str, output_tokens: int) -> None: ...

    def on_finished(
        self,
        tenant: str,
        status: int,
        prompt_tokens: int,
        cached_tokens: int,
        ttft_s: float | None,
        token_times: Sequence[float],
    ) -> None: ...


class GatewayStartError(Exception):
    """The gateway's configuration does not allow serving (said in one line)."""


class GatewayError(Exception):
    """A refusal: `status`, a message, the reason (metrics, audit) and response headers."""

    def __init__(
        self,
        status: int,
        message: str,
        reason: str,
        *,
        retry_after: float | None = None,
        should_retry: bool | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.reason = status, message, reason
        self.retry_after, self.should_retry, self.code = retry_after, should_retry, code


class QueueTimer(Protocol):
    """The API's measure of a request's queue wait (zerohop.api.load.queue_timing), kept on
    its call: the gateway never reads it."""

    actual: float | None

    def sent(self, now: float | None = None) -> None: ...

    def first_delta(self, step_seconds: float, now: float | None = None) -> None: ...

    def headers(self) -> list[tuple[bytes, bytes]]: ...


@dataclass(slots=True)
class Call:
    """One request, from arrival to its audit record."""

    request_id: str
    surface: str  # "anthropic" | "openai" | "grpc"
    client: str | None = None
    http_version: str | None = None
    end_user: str | None = None  # named by a trusted front (api/http/trusted_front.py)
    end_user_email: str | None = None
    started: float = field(default_factory=time.monotonic)
    started_wall: float = field(default_factory=time.time)
    identity: Identity = ANONYMOUS
    presented: KeyRef | None = None  # the known key a refused request's secret is (audit only)
    model: str | None = None
    reservation: Reservation | None = None
    rate_subjects: list[SubjectLimits] = field(default_factory=list)  # charged at admission
    admitted: bool = False
    wants_batch: bool = False  # the request lowered itself to the batch class
    background: bool = False  # a batch line: the scheduler's background class
    batch: tuple[str, str] | None = None  # (batch id, custom_id) of a batch line
    decision: str = "none"  # "admitted" | "clamped" | the refusal reason
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    first_token_at: float | None = None
    first_delta_at: float | None = None
    admitted_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    stop_reason: str | None = None
    status: int | None = None
    error_type: str | None = None
    refusal: str | None = None  # the refusal's message (the admin API's refusals report)
    prompt_text: str | None = None  # only kept with --audit-content
    output_text: list[str] = field(default_factory=list)
    queue_timing: QueueTimer | None = None  # set at admission
    # Work done for this request under a call of its own (a compaction's summary), charged
    # to the limits and budget there: added to this request's counts when it finishes.
    inner_tokens: tuple[int, int, int] = (0, 0, 0)  # prompt, cached, output

    def add_usage(self, inner: Call) -> None:
        """Count `inner`'s tokens (already charged) in this request's record."""
        prompt, cached, output = self.inner_tokens
        done = (inner.prompt_tokens, inner.cached_tokens, inner.output_tokens)
        self.inner_tokens = (prompt + done[0], cached + done[1], output + done[2])

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started


class Gateway:
    def __init__(
        self,
        store: Store,
        authenticator: Authenticator,
        ledger: Ledger | None,
        audit: AuditLog | None = None,
        metrics: GatewayMetrics | None = None,
        ledger_failure: str = "open",
    ) -> None:
        assert ledger_failure in LEDGER_FAILURE_POLICIES, ledger_failure
        # The process's one store (its repositories go to the consumers; closed by close).
        self.store = store
        self.auth = authenticator
        self.limiter = RateLimiter()
        self.rates: FleetRates | None = None  # when the store is shared (fleet.py)
        self.ledger = ledger
        self.ledger_failure = ledger_failure
        self.audit = audit
        self.metrics = metrics
        self.usage: UsageRecorder | None = None  # the admin reports
        self.live: LoadObserver | None = None  # api/load/live_load.py: the console's overview

    @classmethod
    def from_store(
        cls,
        store: StoreSpec | Path,
        verifier: SignedKeyVerifier | None = None,
        durability: Durability = "full",
        local_db: Path | None = None,
        leases: LeaseOptions | None = None,
        local_copy: LocalCopy | None = None,
        audit: AuditLog | None = None,
        metrics: GatewayMetrics | None = None,
        ledger_failure: str = "open",
    ) -> Gateway:
        """Keys from `store`. Budgets: with a SQLite store, a ledger in its file; with
        PostgreSQL, leases of the fleet's budgets (`fleet.py`), and the rate limits shared
        by the fleet too, and its keys kept in `local_copy` to start from while it is down.
        `local_db`: a fleet replica's own SQLite file (its audit logs' chain heads)."""
        spec = store if isinstance(store, StoreSpec) else StoreSpec.sqlite(store)
        opened = Store.of(spec, local_db)  # a fleet replica's own file: local_db
        if spec.kind != "postgresql":
            ledger = BudgetLedger(opened.ledger, durability)  # in the store, as reports read it
            auth = Authenticator(spec, opened.keys, verifier)
            return cls(opened, auth, ledger, audit, metrics, ledger_failure)
        from zerohop.gateway.fleet import join_fleet

        auth = Authenticator(spec, opened.keys, verifier, local_copy)
        gateway = cls(opened, auth, None, audit, metrics, ledger_failure)
        join_fleet(gateway, opened.leases, leases or LeaseOptions())
        return gateway

    def start(self) -> None:
        self.auth.load()
        if self.ledger is not None:
            self.ledger.start()

    @property
    def audits_content(self) -> bool:
        return self.audit is not None and self.audit.include_content

    def start_watching(self) -> None:
        self.auth.start_watching()
        if self.rates is not None:
            self.rates.bind(asyncio.get_running_loop())

    async def close(self) -> None:
        await self.auth.stop()
        if self.ledger is not None:
            await asyncio.to_thread(self.ledger.close)
        if self.usage is not None:
            await asyncio.to_thread(self.usage.close)
        if self.audit is not None:
            await asyncio.to_thread(self.audit.close)  # flushes every record
        await asyncio.to_thread(self.store.close)  # last: every writer above has flushed

    # -- steps of a request -------------------------------------------------------------------

    def authenticate(self, call: Call, token: str | None) -> None:
        try:
            call.identity = self.auth.authenticate(token)
        except AuthenticationError as exc:
            call.decision, call.presented = "authentication", exc.key
            raise GatewayError(401, str(exc), "authentication") from exc
        except InvalidKeyConfiguration as exc:  # a known key, its stored row invalid
            call.decision, call.presented = "invalid_key_configuration", exc.key
            raise GatewayError(
                403, str(exc), call.decision, should_retry=False, code=call.decision
            ) from exc
        if not call.identity.inference:
            call.decision = "permission"
            message = (
                f"API key {call.identity.key_id} is an admin key: it may use the admin API,"
                " not the model (make it with --inference to allow both)"
            )
            raise GatewayError(403, message, "permission", should_retry=False)

    def check_model(self, call: Call, model: str, served: str | None = None) -> None:
        """403 unless the key allows `model`, or `served`: the name `model` is an alias of."""
        call.model = model
        if served is not None and call.identity.allows_model(served):
            return
        try:
            check_model(call.identity, model)
        except PermissionDenied as exc:
            call.decision = "permission"
            raise GatewayError(403, str(exc), "permission") from exc

    async def admit(self, call: Call, prompt_tokens: int, max_tokens: int) -> int:
        """Charge the limits and reserve the budget; return the granted max_tokens."""
        if self.audit is not None and self.audit.refusing:  # --audit-failure closed
            call.decision = "audit_unavailable"
            raise GatewayError(
                503, "the audit log cannot be written now, and this server refuses requests"
                " it cannot audit (--audit-failure closed); retry later",
                call.decision, retry_after=1.0, should_retry=True, code=call.decision,
            )  # fmt: skip
        if self.rates is not None:  # a fleet: this replica's share of the rate limits
            await self.rates.prepare(call.identity)
        admitted = self.limiter.admit(call.identity, prompt_tokens)
        if isinstance(admitted, Refusal):
            raise self._refused(call, admitted)
        granted = max_tokens
        if self.ledger is not None:
            await self.ledger.prepare(call.identity, prompt_tokens, max_tokens)
            try:
                call.reservation = self.ledger.reserve(
                    call.identity, call.request_id, prompt_tokens, max_tokens
                )
            except BudgetExhausted as exc:
                limits.undo_admission(admitted, prompt_tokens)  # refused: nothing was used
                call.decision = "budget"
                wait = refusal_retry_after(call.identity, self.ledger, prompt_tokens)
                raise GatewayError(
                    429, str(exc), "budget", retry_after=wait, should_retry=False,
                    code="insufficient_quota",
                ) from exc  # fmt: skip
            except LeaseUnavailable as exc:
                limits.undo_admission(admitted, prompt_tokens)
                raise _lease_refusal(call, exc) from exc
        call.rate_subjects, call.admitted = admitted, True
        call.prompt_tokens = prompt_tokens  # counted from here: this prompt reaches the engine
        if call.reservation is not None:
            granted = call.reservation.max_tokens
            await self._confirm(call, prompt_tokens)  # durable before the engine sees it
        elif self._refuses_unbudgeted():
            raise self._ledger_refusal(call, prompt_tokens)
        call.decision = "clamped" if granted < max_tokens else "admitted"
        call.admitted_at = time.monotonic()
        return granted

    async def _confirm(self, call: Call, prompt_tokens: int) -> None:
        assert self.ledger is not None and call.reservation is not None
        try:
            await self.ledger.confirm(call.reservation)
        except LedgerUnavailable as exc:
            call.reservation = None  # taken back: nothing to settle
            raise self._ledger_refusal(call, prompt_tokens) from exc

    def _refuses_unbudgeted(self) -> bool:
        ledger = self.ledger
        return self.ledger_failure == "closed" and ledger is not None and ledger.failing

    def _ledger_refusal(self, call: Call, prompt_tokens: int) -> GatewayError:
        """Fail closed: the request never reaches the engine, and uses none of its limits."""
        limits.undo_admission(call.rate_subjects, prompt_tokens)
        call.rate_subjects, call.admitted, call.prompt_tokens = [], False, 0
        call.decision = "ledger"
        message = (
            "the token budget ledger cannot be written (a storage error on this server):"
            " requests are refused until it can; retry later or on another replica"
        )
        return GatewayError(
            503, message, "ledger", retry_after=LEDGER_RETRY_AFTER, should_retry=True,
            code="ledger_unavailable",
        )  # fmt: skip

    def _refused(self, call: Call, refusal: Refusal) -> GatewayError:
        call.decision = refusal.reason
        # No retry-after: a limit of 0, which waiting does not change (do not retry).
        never = refusal.retry_after is None
        return GatewayError(
            429,
            refusal.message,
            refusal.reason,
            retry_after=refusal.retry_after,
            should_retry=False if never else None,
        )

    def on_delta(self, call: Call, new_tokens: int, cached_tokens: int, now: float) -> None:
        """Charge one step's output tokens; refund the prompt tokens the prefix cache served."""
        if call.first_delta_at is None:
            call.first_delta_at = now
        if cached_tokens and not call.cached_tokens:
            call.cached_tokens = cached_tokens
            limits.refund_input(call.rate_subjects, cached_tokens)
        if new_tokens:
            if call.first_token_at is None:
                call.first_token_at = now
            call.output_tokens += new_tokens
            call.token_times.append(now)
            limits.charge_output(call.rate_subjects, new_tokens)
            if self.live is not None:
                self.live.on_tokens(call.identity.tenant.name, new_tokens)
        if call.reservation is not None:
            call.reservation.used = call.prompt_tokens - call.cached_tokens + call.output_tokens

    def release(self, call: Call) -> None:
        """The request left the engine: free its concurrency slot, give back unused budget."""
        if call.admitted:
            call.admitted = False
            limits.release(call.rate_subjects)
        if call.reservation is not None and self.ledger is not None:
            self.ledger.settle(call.reservation)

    def rate_state(self, call: Call) -> dict[str, RateState]:
        return self.limiter.state(call.identity)

    def finish(self, call: Call, status: int, error_type: str | None = None) -> None:
        """The request is over (answered, refused or failed): audit it and count it."""
        self.release(call)
        _fold_inner(call)  # after release: the inner work was settled under its own call
        call.status, call.error_type = status, error_type
        now = time.monotonic()
        if self.metrics is not None:
            if call.decision not in ("none", "admitted", "clamped"):
                self.metrics.refused(call.decision, call.identity.tenant.name)
            self.metrics.request_finished(
                surface=call.surface,
                status=status,
                tenant=call.identity.tenant.name,
                model=call.model or "",
                prompt_tokens=call.prompt_tokens,  # the whole prompt, cache hits included
                cached_tokens=call.cached_tokens,
                output_tokens=call.output_tokens,
                ttft_s=call.ttft,
                e2e_s=now - call.started,
                queue_s=_queue_time(call),
                token_times=call.token_times,
            )
        if self.audit is not None:
            self.audit.record(audit_entry(call, now, self.audit.include_content))
        if self.usage is not None:
            self.usage.record(call)
        if self.live is not None:
            self.live.on_finished(
                call.identity.tenant.name, status, call.prompt_tokens, call.cached_tokens,
                call.ttft, call.token_times,
            )  # fmt: skip


def _lease_refusal(call: Call, exc: LeaseUnavailable) -> GatewayError:
    # As an overloaded replica: the official SDKs retry it, zerohop.client moves it.
    call.decision = "budget_lease"
    status = 529 if call.surface == "anthropic" else 503
    return GatewayError(
        status, str(exc), call.decision, retry_after=exc.retry_after, should_retry=True,
        code="budget_lease_unavailable",
    )  # fmt: skip


def _fold_inner(call: Call) -> None:
    prompt, cached, output = call.inner_tokens
    call.prompt_tokens += prompt
    call.cached_tokens += cached
    call.output_tokens += output
    call.inner_tokens = (0, 0, 0)


def _queue_time(call: Call) -> float | None:
    # From admission to the engine's first report on the request (its first prefill chunk
    # done): the wait for a batch slot plus that chunk.
    if call.admitted_at is None or call.first_delta_at is None:
        return None
    return call.first_delta_at - call.admitted_at


def audit_entry(call: Call, now: float, include_content: bool) -> AuditRecord:
    """The request's audit record; one refused for a known key (revoked, expired) names it."""
    key = call.presented or call.identity.ref()
    entry: AuditRecord = {
        "time": call.started_wall,
        "request_id": call.request_id,
        "key_id": key.key_id,
        "tenant": key.tenant,
        "model": call.model,
        "surface": call.surface,
        "http_version": call.http_version,
        "client": call.client,
        "status": call.status,
        "error_type": call.error_type,
        "stop_reason": call.stop_reason,
        "input_tokens": call.prompt_tokens - call.cached_tokens,
        "cached_tokens": call.cached_tokens,
        "output_tokens": call.output_tokens,
        "ttft_s": call.ttft,
        "duration_s": now - call.started,
        "decision": call.decision,
    }
    if call.end_user is not None:
        entry["end_user"] = call.end_user
    if call.end_user_email is not None:
        entry["end_user_email"] = call.end_user_email
    if call.batch is not None:
        entry["batch_id"], entry["custom_id"] = call.batch
    if call.reservation is not None:
        entry["budget_reserved"] = call.reservation.reserved
    if include_content:
        entry["prompt"] = call.prompt_text
        entry["output"] = "".join(call.output_text)
    return entry
