"""The operator's admin API (docs/admin-api.md): admin keys, sessions, the routes."""
