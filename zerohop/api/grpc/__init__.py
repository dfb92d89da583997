"""The gRPC surface: zerohop.v1.Zerohop over grpc.aio, its request decoding (tools.py,
constraint.py) and error record. Imports api.errors, api.serving, api.conversation,
api.generation, api.tools, api.http
(rate headers, the error record), the engine's grammars and zerohop.grpc_gen; no other
surface.
"""
