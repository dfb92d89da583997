"""The key store and its backends: SQLite (one replica) and PostgreSQL (a fleet) with its schema,
migrations and metrics, rows read back checked, the usage tables, a
fleet's budget leases and rate shares (on a connection of their own). Imports gateway.keys.
"""
