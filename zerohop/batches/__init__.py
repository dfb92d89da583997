"""Batches: the Anthropic Message Batches API and OpenAI's Files + Batches API.

A batch and its lines live in an embedded store (`store.py`, SQLite beside the key store,
file contents beside it on disk), so a restart resumes a batch where it was. Each line runs
as an ordinary request (same keys, limits, budget and audit) in the scheduler's background
class, on capacity interactive work leaves.

Imports api (errors, http, serving), gateway and the engine's client-side types (its client's
queue figures, engine.base's stats, engine.sched's request classes and step times); imported
by admin and app.
"""
