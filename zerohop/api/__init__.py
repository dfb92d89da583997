"""The surfaces (Anthropic Messages, OpenAI Chat/Completions, OpenAI Responses, gRPC), each a
wire mapping over one neutral conversation (conversation/) and `service.ServingContext`. May
import gateway, engine and grpc_gen; never batches, admin, console or app (they are built on
it).
"""
