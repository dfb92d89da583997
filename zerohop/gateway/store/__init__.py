"""The key store and its backends: SQLite (one replica) and PostgreSQL (a fleet) with its schema,
migrations and metrics, rows read back checked, the usage tables. Imports gateway.keys.
"""
