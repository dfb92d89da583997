"""`zerohop_batch_lines{tenant,state}`: batch lines waiting, running and done per tenant,
from the runner's counts (refreshed off the request path), never a query at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from zerohop.batches.runner import BatchRunner


class BatchMetrics(Collector):
    def __init__(self, runner: BatchRunner) -> None:
        self.runner = runner

    def describe(self) -> Iterator[Metric]:  # the name, so a second registration is refused
        yield GaugeMetricFamily("zerohop_batch_lines", "Batch lines by tenant and state.")

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "zerohop_batch_lines",
            "Batch lines by tenant and state (done: succeeded, errored, canceled or expired).",
            labels=["tenant", "state"],
        )
        for tenant, counts in sorted(self.runner.counts.items()):
            family.add_metric([tenant, "waiting"], counts.waiting)
            family.add_metric([tenant, "running"], counts.running)
            family.add_metric([tenant, "done"], counts.finished)
        yield family
