"""One request's queue wait, predicted at admission and measured, sent as response headers.

- `zerohop-predicted-queue-wait-ms`: what admission control predicted for this request
  (zerohop.api.load.queue_model), the figure it compared with `--max-queue-wait`.
- `zerohop-actual-queue-wait-ms`: the wait it had, from the moment it was sent to the engine
  to the start of the engine step that computed its first prompt chunk: the time its first
  delta came back, less that step's time (`EngineStats.step_seconds`, sent with the delta).
  The same clock and the same end points as the prediction, so actual / predicted is the
  model's error, without the request's own prefill or the time to its first token.

Both go out with the response's headers: after the first delta on a stream, after the whole
answer otherwise, so a streamed response carries both. (gRPC's initial metadata carries the
load only.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from zerohop.api.load.wait_correction import WaitCorrection

PREDICTED_HEADER = b"zerohop-predicted-queue-wait-ms"
ACTUAL_HEADER = b"zerohop-actual-queue-wait-ms"


@dataclass(slots=True)
class QueueTiming:
    predicted: float | None  # seconds; None while the engine has not measured a step
    model: float | None = None  # the step-time model's figure, before the correction
    correction: WaitCorrection | None = None  # told the measured wait against `model`
    sent_at: float | None = None  # time.monotonic() when handed to the engine
    actual: float | None = None  # seconds

    def sent(self, now: float | None = None) -> None:
        self.sent_at = time.monotonic() if now is None else now

    def first_delta(self, step_seconds: float, now: float | None = None) -> None:
        """The request's first delta came back from a step that took `step_seconds`."""
        if self.actual is not None or self.sent_at is None:
            return
        now = time.monotonic() if now is None else now
        self.actual = max(0.0, now - self.sent_at - step_seconds)
        if self.correction is not None and self.model is not None:
            self.correction.observe(self.model, self.actual)

    def headers(self) -> list[tuple[bytes, bytes]]:
        pairs = []
        if self.predicted is not None:
            pairs.append((PREDICTED_HEADER, _ms(self.predicted)))
        if self.actual is not None:
            pairs.append((ACTUAL_HEADER, _ms(self.actual)))
        return pairs


def _ms(seconds: float) -> bytes:
    return str(round(seconds * 1000)).encode()
