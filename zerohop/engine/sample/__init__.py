"""Choosing tokens: sampling parameters, the sampler, vLLM's logits processors, prompt-lookup
speculation and thinking budgets. Imports engine.base only.
"""
