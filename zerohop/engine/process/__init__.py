"""The engine in its own process: the child's step loop over a socket, msgpack framing, the
asyncio-side AsyncEngine and the supervisor that restarts it. Imports the rest of the engine;
nothing in the engine imports it.
"""
