"""The gateway: keys, rate limits, token budgets, audit and metrics, inside the runtime.

Nothing here knows HTTP: the API surfaces translate headers in and errors out. Imports no
other zerohop package (the scheduler reaches it only through the engine's policy hooks). Its
own modules (gateway.py, auth.py, usage.py, fleet.py, ...) stand on its sub-packages, which
never import them: keys; store on keys; budgets, limits and audit on keys and store.
"""
