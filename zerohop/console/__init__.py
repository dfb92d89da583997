"""The operator's console: pages served by the replica itself (docs/admin-api.md).
Built on admin and api (errors, http); imported only by app."""
