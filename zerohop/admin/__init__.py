"""The operator's admin API (docs/admin-api.md): admin keys, sessions, the routes.
Built on api (errors, http, load, serving), gateway and the batch store's type (batches);
imported only by console and app."""
