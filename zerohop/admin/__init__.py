"""The operator's admin API (docs/admin-api.md): admin keys, sessions, the routes.
Built on api (its ASGI helpers, live load) and gateway; imported only by console and app."""
