"""How a fleet replica holds its budget leases and rate shares, and the local copy of the
fleet's keys it keeps (`serve --store`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True, frozen=True)
class LeaseOptions:
    ttl: float = 60.0  # seconds a lease lives unrenewed; its unspent rest is then charged
    wait: float = 0.25  # seconds a request waits for a top-up (budget or rate share)
    horizon: float = 10.0  # seconds of recent spend a budget lease is sized to hold

    @property
    def heartbeat(self) -> float:
        """Seconds between renewals: several per TTL, at most one a second."""
        return min(1.0, self.ttl / 4)


@dataclass(slots=True, frozen=True)
class SnapshotOptions:
    """The local copy of the fleet's keys a replica starts from while PostgreSQL is down
    (`zerohop.gateway.store.key_snapshot`)."""

    path: Path | None = None  # None: store-snapshot.json beside the replica's --keys-db
    max_age: float = 24 * 3600.0  # seconds since its keys were read from the store, at most
