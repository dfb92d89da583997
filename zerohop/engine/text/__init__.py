"""Text in and out: tokenizers (tokenizer.json or GGUF metadata), the chat template, and the
incremental detokenizer with stop strings. Imports engine.base only.
"""
