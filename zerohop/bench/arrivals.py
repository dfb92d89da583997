"""When an open-loop benchmark sends each request: a gamma process, as `vllm bench serve`.

Gaps between requests are gamma-distributed with shape `burstiness` and mean 1 / `rate`:
burstiness 1 is a Poisson process, below 1 burstier (clustered sends, long pauses), above 1
more even; infinite `rate` sends everything at once.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator


def send_times(rate: float, burstiness: float = 1.0, seed: int = 0) -> Iterator[float]:
    """Seconds after the start at which each request goes out (endless)."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be positive")
    rng = random.Random(f"arrivals-{seed}")
    theta = 1.0 / (rate * burstiness)
    t = 0.0
    while True:
        yield t
        if not math.isinf(rate):
            t += rng.gammavariate(burstiness, theta)
