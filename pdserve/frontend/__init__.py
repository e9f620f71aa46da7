"""The frontend: the public gRPC API, request validation, and the router."""
