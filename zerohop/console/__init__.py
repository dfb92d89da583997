"""The operator's console: pages served by the replica itself (docs/admin-api.md)."""
