"""The fleet store in `GET /metrics`: whether it answers, how fast, and the leases and rate
shares this replica holds (registered with `GatewayMetrics.register` under `--store`).

Read at scrape time from counters the key feed's and lease keeper's threads keep in
memory, and the local snapshot's age and state: a scrape never queries PostgreSQL. Lease
gauges are summed per tenant (a key's lease counts for its tenant), so the series stay as
few as the tenants.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from zerohop.gateway.budgets.lease_keeper import RESULTS, LeaseKeeper


class StoreMetrics(Collector):
    def __init__(self, keeper: LeaseKeeper, auth: Any, rates: Any | None) -> None:
        self.keeper, self.auth, self.rates = keeper, auth, rates

    @property
    def feed(self) -> Any | None:
        """The Authenticator's key feed (started once the server watches the store)."""
        return self.auth.feed

    def describe(self) -> Iterator[Metric]:
        return self.collect()

    def collect(self) -> Iterator[Metric]:
        stats = self.keeper.stats
        up = stats.up and (self.feed is None or self.feed.up)
        yield GaugeMetricFamily(
            "zerohop_store_up",
            "1 while the fleet store (PostgreSQL) answers this replica's lease keeper and key"
            " feed, else 0 (serving on the leases and keys it holds).",
            value=int(up),
        )
        latency = HistogramMetricFamily(
            "zerohop_store_latency_seconds", "Lease transactions with the fleet store."
        )
        latency.add_metric([], stats.latency.buckets(), sum_value=stats.latency.total)
        yield latency
        errors = stats.errors + (self.feed.errors if self.feed is not None else 0)
        yield CounterMetricFamily(
            "zerohop_store_errors", "Failed attempts to reach the fleet store.", value=errors
        )
        yield from self._feed()
        yield from self._snapshot()
        yield from self._leases()
        yield from self._shares()

    def _feed(self) -> Iterator[Metric]:
        if self.feed is None:
            return
        reloads = CounterMetricFamily(
            "zerohop_keys_reloads",
            "Key index reloads from the store, by trigger.",
            labels=["trigger"],
        )
        for trigger, count in self.feed.reloads.items():
            reloads.add_metric([trigger], count)
        yield reloads
        if self.feed.last_propagation is not None:
            yield GaugeMetricFamily(
                "zerohop_keys_propagation_seconds",
                "From the last key change's commit to its index here (wall clocks: approximate).",
                value=self.feed.last_propagation,
            )

    def _snapshot(self) -> Iterator[Metric]:
        local = self.auth.local_copy
        if local is None:
            return
        yield GaugeMetricFamily(
            "zerohop_store_snapshot_serving",
            "1 while this replica serves the keys of its local snapshot (it started while the"
            " fleet store could not be reached and has not read it since), else 0.",
            value=int(local.serving),
        )
        age = local.age()
        if age is not None:
            yield GaugeMetricFamily(
                "zerohop_store_snapshot_age_seconds",
                "Seconds since the keys in the local snapshot were read from the fleet store.",
                value=age,
            )
        yield CounterMetricFamily(
            "zerohop_store_snapshot_write_errors",
            "Failed writes of the local snapshot of the fleet's keys.",
            value=local.write_errors,
        )

    def _leases(self) -> Iterator[Metric]:
        stats, now = self.keeper.stats, time.monotonic()
        granted: dict[str, int] = defaultdict(int)
        available: dict[str, int] = defaultdict(int)
        ledger = self.keeper.ledger
        with ledger.lock:
            for lease in ledger.leases.values():
                granted[lease.tenant] += lease.granted - lease.spent
                available[lease.tenant] += lease.available(now)
        for name, values, help_text in (
            ("zerohop_budget_lease_held_tokens", granted, "Budget tokens leased here, unspent."),
            ("zerohop_budget_lease_available_tokens", available, "Leased tokens free to reserve."),
        ):
            family = GaugeMetricFamily(name, help_text, labels=["tenant"])
            for tenant, value in sorted(values.items()):
                family.add_metric([tenant], value)
            yield family
        renewals = CounterMetricFamily(
            "zerohop_budget_lease_renewals",
            "Lease top-ups asked of the store, by result (full, partial, none, error).",
            labels=["result"],
        )
        for result in RESULTS:
            renewals.add_metric([result], stats.renewals[result])
        yield renewals
        yield CounterMetricFamily(
            "zerohop_budget_lease_returned_tokens",
            "Leased tokens given back to the fleet (idle, scarce, drained).",
            value=stats.returned_tokens,
        )
        yield CounterMetricFamily(
            "zerohop_budget_lease_expiries",
            "Expired leases of stopped replicas this replica charged.",
            value=stats.expiries,
        )

    def _shares(self) -> Iterator[Metric]:
        if self.rates is None:
            return
        family = GaugeMetricFamily(
            "zerohop_rate_share_ratio",
            "This replica's share of a tenant's per-minute limits.",
            labels=["tenant"],
        )
        for subject, share in sorted(self.rates.shares().items()):
            if subject.startswith("tenant:"):
                family.add_metric([subject.removeprefix("tenant:")], share)
        yield family
