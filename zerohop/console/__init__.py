"""The operator's console: pages served by the replica itself (docs/admin-api.md).
Built on admin, api and gateway; imported only by app."""
