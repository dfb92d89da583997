"""Generated gRPC code (scripts/gen_grpc.py from proto/); do not edit."""
