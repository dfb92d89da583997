"""How a fleet replica holds its budget leases and rate shares (`serve --store`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class LeaseOptions:
    ttl: float = 60.0  # seconds a lease lives unrenewed; its unspent rest is then charged
    wait: float = 0.25  # seconds a request waits for a top-up (budget or rate share)
    horizon: float = 10.0  # seconds of recent spend a budget lease is sized to hold

    @property
    def heartbeat(self) -> float:
        """Seconds between renewals: several per TTL, at most one a second."""
        return min(1.0, self.ttl / 4)
