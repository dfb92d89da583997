"""What every API surface stands on: the ServingContext (service.py: the engine, tokenizer,
gateway and limits a request is served with), the served model names (model_names.py) and
GET /v1/models (model_list.py), the one output-length policy (output_length.py), identical
requests attaching to one run (shared_runs.py) and the signing of thinking blocks
(thought_signatures.py). Imports api.errors, api.http, api.load, api.tools, gateway and
engine; never a surface, api.conversation or api.generation (they are built on it).
"""
