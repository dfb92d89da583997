"""What rides on a vLLM request for zerohop's scheduler class (`FairShareScheduler`): the
caller's tenant, fair-share weight and priority class, in `SamplingParams.extra_args`. vLLM
carries extra_args from the API process to its EngineCore unchanged, so the scheduler reads
them off the request itself, never through a global."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

EXTRA_ARGS_KEY = "zerohop"
DEFAULT_TENANT = "default"


@dataclass(slots=True, frozen=True)
class RequestTags:
    tenant: str = DEFAULT_TENANT
    weight: float = 1.0
    priority: int = 0  # zerohop.engine.sched.fair_share: INTERACTIVE, BATCH, BACKGROUND

    def to_extra_args(self) -> dict[str, Any]:
        return {
            EXTRA_ARGS_KEY: {"tenant": self.tenant, "weight": self.weight, "class": self.priority}
        }

    @classmethod
    def from_extra_args(cls, extra_args: dict[str, Any] | None) -> RequestTags:
        """The tags a request carries; a request without them (added by another client of
        the engine) is the default tenant's, interactive."""
        tags = (extra_args or {}).get(EXTRA_ARGS_KEY)
        if not isinstance(tags, dict):
            return cls()
        return cls(str(tags["tenant"]), float(tags["weight"]), int(tags["class"]))
