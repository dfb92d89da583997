"""The composition root of `zerohop serve`: its options (options.py), the gateway it starts
(gateway_start.py), what it keeps in its store (stores.py) and hands the routes beside the
shared context (services.py), the ASGI application over the surfaces, batches, admin and
console (routes.py) and the servers and engine it runs (server.py). May import every package
below it (api, gateway, engine, batches, admin, console); only zerohop.cli imports it.
"""
