"""OpenMP's wait policy, set before torch loads OpenMP (the engine package imports this first).

torch's OpenMP workers should sleep between parallel regions rather than spin, because
zerohop's own kernel threads (kernels/spin_pool.h) and the API process need those cores in
between. Measured offline on SmolLM2 with 2 threads: 346 ms prefill and 14.1 ms a token against
564 ms and 22.7 ms with spinning workers. A value the user set wins; if torch was loaded first,
the engine keeps torch to one thread instead (`WORKERS_SLEEP` is False).

Only the processes that run the engine set it: `import zerohop` and `zerohop.client` leave the
caller's environment alone.
"""

from __future__ import annotations

import os
import sys

WORKERS_SLEEP = os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE" or (
    "torch" not in sys.modules and "OMP_WAIT_POLICY" not in os.environ
)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
