"""Load: live per-second figures, overload refusal, and queue-wait prediction and correction.
Imports api.errors, the engine client's queue figures and engine.sched's step times.
"""
