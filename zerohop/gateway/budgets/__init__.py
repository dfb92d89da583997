"""Token budgets: the SQLite ledger and its writer thread, the fleet's leased ledger and the thread
that keeps its leases (their SQL is the store's lease repository's). Imports gateway.keys and
gateway.store.
"""
