"""Models on disk: a Hugging Face folder (config.json, safetensors) or a GGUF file, opened as one
checkpoint. Imports engine.model (its config and quantized layouts), engine.text's tokenizer
and engine.base; never the engine's own modules.
"""
