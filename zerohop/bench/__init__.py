"""Measuring a server: `zerohop bench` (load, vLLM's metrics, plots) and `zerohop probe`.

`load` is the load client (closed or open loop) with `arrivals` (send times), `workloads`
(ShareGPT files), `grpc_load` (the gRPC surface), `metrics` (summary, goodput, report) and
`plots` (PNG); `cli` is the `zerohop bench` command. `probe*` is `zerohop probe` (one request,
timed hop by hop). Nothing is imported here, so building the CLI parser stays cheap.
"""

from __future__ import annotations

ENDPOINTS = ("openai-completions", "openai-chat", "anthropic-messages", "grpc")
