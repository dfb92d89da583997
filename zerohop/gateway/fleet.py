"""A replica joining its fleet: budgets as leases, rate limits as shares, and their metrics,
all kept by one thread talking to the fleet's PostgreSQL (`serve --store URL`) through the
store's lease repository (`Store.leases`)."""

from __future__ import annotations

from importlib import metadata
from typing import TYPE_CHECKING, Protocol

from zerohop.gateway.budgets.lease_keeper import LeaseKeeper, open_leased_ledger
from zerohop.gateway.budgets.ledger import Ledger
from zerohop.gateway.fleet_options import LeaseOptions
from zerohop.gateway.limits.buckets import RateLimiter
from zerohop.gateway.limits.fleet_shares import FleetRates
from zerohop.gateway.store.lease_repository import LeaseRepository

if TYPE_CHECKING:
    from zerohop.gateway.auth import Authenticator
    from zerohop.gateway.metrics import GatewayMetrics


class FleetMember(Protocol):
    """What joining a fleet changes of a Gateway (zerohop.gateway.gateway, which calls this
    module: a Protocol, so that this module need not import it)."""

    auth: Authenticator
    limiter: RateLimiter
    ledger: Ledger | None
    rates: FleetRates | None
    metrics: GatewayMetrics | None


def join_fleet(gateway: FleetMember, leases: LeaseRepository, options: LeaseOptions) -> None:
    """Give `gateway` (a Gateway, not started yet) the fleet's ledger and rate shares, kept
    through `leases` (the gateway's store's lease repository)."""
    ledger = open_leased_ledger(
        leases,
        lease_wait=options.wait,
        horizon=options.horizon,
        ttl=options.ttl,
        heartbeat=options.heartbeat,
        version=metadata.version("zerohop"),
    )
    keeper = ledger.keeper
    assert isinstance(keeper, LeaseKeeper)  # open_leased_ledger made it
    rates = FleetRates(gateway.limiter, options.wait, keeper)
    keeper.share_rates(rates)
    gateway.ledger, gateway.rates = ledger, rates
    if gateway.metrics is not None:
        from zerohop.gateway.fleet_metrics import StoreMetrics

        gateway.metrics.register(StoreMetrics(keeper, gateway.auth, rates))
