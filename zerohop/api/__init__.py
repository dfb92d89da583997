"""The surfaces (Anthropic Messages, OpenAI Chat/Completions, OpenAI Responses, gRPC), each a
wire mapping over one neutral conversation (conversation/) and `serving.service.ServingContext`.

The package's own module, errors.py (ApiError and its wire shapes), imports nothing; the
sub-packages stand on it and on each other one way: http, load and tools; serving on them;
conversation on serving and tools; generation on conversation; the surfaces (anthropic,
openai, responses on openai, grpc) on all of these. May import gateway, engine and grpc_gen;
never batches, admin, console or app (they are built on it).
"""
