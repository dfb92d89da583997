"""Model loading, paged KV cache, scheduler, runner, sampler and tokenizers.

Knows nothing of HTTP or API keys; the gateway talks to it through `policy`.
"""

# First, before any engine module loads torch: OpenMP's wait policy (see omp.py).
from zerohop.engine import omp as omp
