"""The HTTP (Anthropic + OpenAI) and gRPC surfaces: translate, call the engine, translate back."""
