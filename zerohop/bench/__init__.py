"""Measuring a server: `zerohop bench` (load, vLLM's metrics, plots) and `zerohop probe`.

`load` is the run loop (closed or open loop) with `arrivals` (send times), `load_types` (the
config, request and result types), `http_load` (the HTTP client) with `prompts` (prompts and
request bodies) and `token_events` (reading a stream), `grpc_load` (the gRPC surface),
`workloads` (ShareGPT files), `metrics` (summary, goodput, report) and `plots` (PNG); `cli` is
the `zerohop bench` command. `probe*` is `zerohop probe` (one request,
timed hop by hop). Nothing is imported here, so building the CLI parser stays cheap.
Imports zerohop.sse (and zerohop.grpc_gen) only; imported by zerohop.cli.
"""

from __future__ import annotations

ENDPOINTS = ("openai-completions", "openai-chat", "anthropic-messages", "grpc")
