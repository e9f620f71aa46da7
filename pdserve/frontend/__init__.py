"""The frontend: the public gRPC and OpenAI HTTP APIs, request validation, and the router."""
