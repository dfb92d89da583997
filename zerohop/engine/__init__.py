"""Model loading, paged KV cache, scheduler, runner, sampler and tokenizers.

Knows nothing of HTTP or API keys: each request arrives with its tenant, weight and priority,
and the scheduler orders them through a `SchedulingPolicy` (sched/policy.py). Imports no
other zerohop package.
"""

# First, before any engine module loads torch: OpenMP's wait policy (see omp.py).
from zerohop.engine import omp as omp
