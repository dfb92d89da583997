"""Tool use, shared by the surfaces: tool definitions (spec.py), how they reach the model
(prompt.py), the grammar of a forced call (forced.py) and the incremental parser of the
model's calls (hermes.py). The surfaces translate their API's shapes to and from these."""
