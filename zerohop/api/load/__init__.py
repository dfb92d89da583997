"""Load: live per-second figures, overload refusal, and queue-wait prediction and correction.
Imports the engine's outputs only.
"""
