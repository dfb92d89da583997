"""Model loading, paged KV cache, scheduler, runner, sampler and tokenizers.

Knows nothing of HTTP or API keys: each request arrives with its tenant, weight and priority,
and the scheduler orders them through a `SchedulingPolicy` (sched/policy.py). Imports no
other zerohop package (engine.vllm alone turns a GGUF file into a folder with zerohop.models).

Rooms, one way down: the engine's own modules (engine.py, lifecycle.py, step.py, runner.py,
config.py, client.py, llm.py) assemble its sub-packages; below them loading → model, text;
structured → sched, text; sched → sample, text; model and structured → kernels; and every
one → base (errors, outputs), which imports nothing. No sub-package below imports the
engine's own modules. process and vllm sit above them: they run the engine, so they import
its modules, and nothing in the engine imports them.
"""

# First, before any engine module loads torch: OpenMP's wait policy (see omp.py).
from zerohop.engine import omp as omp
