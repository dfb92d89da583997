"""The audit writer's counters in `GET /metrics` (registered with `GatewayMetrics.register`)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from zerohop.gateway.audit.log import AuditLog


class AuditMetrics(Collector):
    """Read at scrape time from the writer's counters."""

    def __init__(self, audit: AuditLog) -> None:
        self.audit = audit

    def describe(self) -> Iterator[Metric]:  # the names, so a second registration is refused
        return self.collect()

    def collect(self) -> Iterator[Metric]:
        audit, failures = self.audit, self.audit.failures
        yield CounterMetricFamily(
            "zerohop_audit_records_written", "Audit records written.", value=audit.written
        )
        yield CounterMetricFamily(
            "zerohop_audit_records_lost",
            "Audit records that could not be written and were given up.",
            value=failures.lost,
        )
        yield CounterMetricFamily(
            "zerohop_audit_write_errors",
            "Audit log writes that failed (each is retried).",
            value=failures.write_errors,
        )
        yield GaugeMetricFamily(
            "zerohop_audit_records_pending",
            "Audit records kept in memory until the log can be written again.",
            value=failures.pending,
        )
        yield GaugeMetricFamily(
            "zerohop_audit_failing",
            "1 while the last audit log write failed, else 0.",
            value=int(failures.failing),
        )
