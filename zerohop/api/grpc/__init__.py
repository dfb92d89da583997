"""The gRPC surface: zerohop.v1.Zerohop over grpc.aio, its tools mapping and error record.
Imports api.service, api.conversation and zerohop.grpc_gen.
"""
