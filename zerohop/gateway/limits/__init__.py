"""Rate limits: per-minute token buckets (Anthropic's semantics) and a fleet replica's shares.
Imports gateway.keys and gateway.store.
"""
