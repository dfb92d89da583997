"""Serving benchmark: an aiohttp load client with vLLM's latency and throughput metrics.

`zerohop.bench.load` holds the client and the metrics; `zerohop.bench.cli` the `zerohop bench`
command. Nothing is imported here, so building the CLI parser stays cheap.
"""

from __future__ import annotations

ENDPOINTS = ("openai-completions", "openai-chat", "anthropic-messages", "grpc")
