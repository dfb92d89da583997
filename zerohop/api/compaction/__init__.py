"""Compaction, done by the served model: the earlier turns of a conversation summarized
(summarize.py), and the summary sealed into a signed, tenant-scoped blob that a later request
carries back (seal.py). Imports api.errors, api.conversation, api.generation, api.serving and
gateway; imported by the surfaces (anthropic, responses), never the other way.
"""
