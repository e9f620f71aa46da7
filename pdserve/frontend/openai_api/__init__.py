"""The OpenAI-compatible HTTP API: an adapter over the frontend's ``Gateway``, as the gRPC service is."""
