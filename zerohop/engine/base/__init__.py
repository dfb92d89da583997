"""What every part of the engine and every caller of it share: the errors it raises
(errors.py) and what it reports (outputs.py: per-request deltas, pool and cache counters).
Torch-free. Imports nothing of zerohop, so that every engine sub-package, the engine's own
modules and the API can import it without a circle.
"""
