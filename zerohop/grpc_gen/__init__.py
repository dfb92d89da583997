"""Generated gRPC code (scripts/gen_grpc.py from proto/); do not edit.
Shared by the server (api/grpc) and the client (client/grpc_bridge); imports nothing of zerohop."""
