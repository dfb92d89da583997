"""The Llama-family decoder and its parts: attention over the paged cache, rotary embeddings,
linear layers (dense and block-quantized), fused kernels, and the model's config.json
(config.py). Imports engine.kernels and engine.base only; the runner of one forward pass over
the scheduler's batch is the engine's own (engine/runner.py).
"""
