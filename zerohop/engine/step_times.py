"""How long the engine's steps take by their size, learned online from its own steps.

A step's time depends mostly on how many tokens it computes (the rows of every matmul): a
decode step of 16 running requests computes 16 tokens in barely more time than one request's
1, and a prefill of 2,048 tokens takes about 16 times what 128 do. So the steps are kept by
size: one bucket per power of two of tokens, each an exponentially weighted mean (EWMA) of
the tokens and the seconds of the steps that fell in it. The API process turns the buckets
into a curve (zerohop.api.queue_model.StepCurve) to predict the wait of a new request at
the batch sizes it will run at, not at the recent load's.

Torch-free: the table travels in the engine's stats (`EngineStats.step_times`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_ALPHA = 0.2  # weight of the newest step in its bucket's mean


@dataclass(slots=True)
class Bucket:
    tokens: float
    seconds: float
    steps: int = 1

    def add(self, tokens: int, seconds: float, alpha: float) -> None:
        # The first steps of a bucket average plainly, so one outlier does not stick.
        weight = max(alpha, 1.0 / (self.steps + 1))
        self.tokens += weight * (tokens - self.tokens)
        self.seconds += weight * (seconds - self.seconds)
        self.steps += 1


@dataclass(slots=True)
class StepTimes:
    alpha: float = DEFAULT_ALPHA
    buckets: dict[int, Bucket] = field(default_factory=dict)  # by bit length of tokens

    def record(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        key = (tokens - 1).bit_length()  # 1 -> 0, 2 -> 1, 3..4 -> 2, 5..8 -> 3, ...
        bucket = self.buckets.get(key)
        if bucket is None:
            self.buckets[key] = Bucket(float(tokens), seconds)
        else:
            bucket.add(tokens, seconds, self.alpha)

    def table(self) -> list[list[float]]:
        """[[tokens, seconds], ...] by tokens: each bucket's mean step."""
        return [[b.tokens, b.seconds] for _, b in sorted(self.buckets.items())]
