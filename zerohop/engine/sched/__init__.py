"""The scheduler: continuous batching over the paged block pool with prefix caching, fair share
between tenants, the prefill budget, n-choice forks. Imports engine.sample, engine.text and
engine.base; the model runner a fork copies blocks with is a Protocol (fork.BlockCopier).
"""
