"""Constrained decoding: grammars (grammar.py), compiled off the step loop (compiler.py),
one matcher per request whose token bitmask the batched step applies (masking.py).
Imports engine.kernels, engine.sched's sequences, engine.text's tokenizer and engine.base."""
