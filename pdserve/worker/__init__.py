"""A worker: the engine behind a gRPC service, in one of two roles.

- ``runtime``: what both roles share: the engine loop, registration, load publishing, drain;
- ``prefill``: the prefill role's service (prompt KV and the first token, blocks pinned);
- ``decode``: the decode role's service (pull the prompt's KV over NIXL, then stream tokens);
- ``config`` and ``main``: the worker's options and its process.
"""
