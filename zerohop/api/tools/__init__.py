"""Tool use, shared by the surfaces: tool definitions (spec.py), how they reach the model
(prompt.py), the grammar of a forced call (forced.py) and the incremental parser of the
model's calls (hermes.py, llama3.py, mistral.py, forced_stream.py). Used through
api/conversation's planner and reader; imports only the engine's errors and grammars."""
