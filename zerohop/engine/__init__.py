"""Model loading, paged KV cache, scheduler, runner, sampler and tokenizers.

Knows nothing of HTTP or API keys; the gateway talks to it through `policy`.
"""
