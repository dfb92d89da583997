"""Models on disk: a Hugging Face folder (config.json, safetensors) or a GGUF file, opened as one
checkpoint. Imports engine.config and engine.model's quantized layouts.
"""
