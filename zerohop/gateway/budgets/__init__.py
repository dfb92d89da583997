"""Token budgets: the SQLite ledger and its writer thread, the fleet's leased ledger, its PostgreSQL
leases and the thread that keeps them. Imports gateway.keys and gateway.store.
"""
