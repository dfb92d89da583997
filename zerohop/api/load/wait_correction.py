"""What the measured waits teach the queue-wait model: actual / predicted, learned online.

The step-time model (zerohop.api.load.queue_model) prices the engine's steps; what it cannot see
is time outside them: a busy event loop in this process, other processes on the machine
slowing the engine between its measurements. Each admitted request's measured wait
(zerohop.api.load.queue_timing) against the model's prediction for it updates an exponentially
weighted mean of their ratio, and every prediction is the model's times that factor.
Admission goes by an upper figure, `upper`: the mean ratio plus `spread_weight` times their
mean absolute deviation, so that a request is refused when a wait above the limit is likely,
not only when the average wait is (under overload the measured ratio's p90 ran ~1.5 with a
mean of ~1.1, and a request admitted on the mean waited past the limit). Predictions under
`floor` seconds say little about a ratio and are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class WaitCorrection:
    factor: float = 1.0
    alpha: float = 0.05  # weight of the newest request's ratio
    floor: float = 0.05  # seconds
    low: float = 0.5  # the factor's bounds: one odd measurement never swings it far
    high: float = 4.0
    spread: float = 0.0  # mean absolute deviation of the ratios from `factor`
    spread_weight: float = 2.0

    def __call__(self, model_seconds: float) -> float:
        return model_seconds * self.factor

    def upper(self, model_seconds: float) -> float:
        """A wait the request is unlikely to exceed: what admission compares with the limit."""
        return model_seconds * (self.factor + self.spread_weight * self.spread)

    def observe(self, model_seconds: float, actual_seconds: float) -> None:
        if model_seconds < self.floor:
            return
        ratio = min(self.high, max(self.low, actual_seconds / model_seconds))
        self.spread += self.alpha * (abs(ratio - self.factor) - self.spread)
        self.factor += self.alpha * (ratio - self.factor)
