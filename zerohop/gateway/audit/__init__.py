"""The audit log: hash-chained JSON Lines records written off the request path, their chain heads,
the writer's failure modes and metrics, and search. Imports nothing else of zerohop but the
store's chain-head repository (gateway.store.audit_heads), where the heads are kept.
"""
