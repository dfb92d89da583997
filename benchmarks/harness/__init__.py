"""The benchmarks' one harness: what every program needs and none measures.

- `procs`: a server process in a session of its own, ready on a probe, stopped with its
  children; free ports; waiting for a quiet machine; a deliberate busy neighbour.
- `zerohop_server`: `zerohop serve` as a subprocess (this checkout or a baseline tree), its
  API and engine processes, and a key store with one generous key.
- `peers`: the servers zerohop is compared with, each installed into its own cache or venv:
  llama.cpp's `llama-server`, plain `vllm serve`, nginx, LiteLLM's proxy and Redis.
- `layered`: nginx (TLS) -> LiteLLM + Redis in front of any OpenAI-compatible upstream.
- `vllm_bench`: vLLM's own `vllm bench serve` client, the CPU of the servers over its
  measured window, and its per-request figures.
- `ab`: a git ref checked out into a worktree, and rounds that alternate the trees.
- `report`: a plain table on the terminal, a markdown table and the JSON beside it.

Benchmarks run as scripts from `benchmarks/`, so this package imports as `harness`.
"""
