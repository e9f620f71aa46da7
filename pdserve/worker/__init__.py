"""A worker: the engine behind a gRPC service, in one of two roles.

- ``runtime``: what both roles share: the engine loop, registration, load publishing, drain;
- ``prefill``: the prefill role's service (prompt KV and the first token, blocks pinned);
- ``decode``: the decode role's service (pull the prompt's KV over NIXL, then stream tokens);
- ``roles``: the service each role runs;
- ``kv_announcer``: a prefill worker's ``KVReady`` to the request's decode worker, sent from the engine thread;
- ``kv_mailbox``: where a decode worker's pending Decode calls receive their ``KVReady``;
- ``data_parallel``: data-parallel attention ranks, each a worker of its own, and their ranks' program;
- ``config``: the worker's options;
- ``main``: the worker's process (one rank, a tensor-parallel group, or data-parallel ranks);
- ``follower``: a worker process that is rank 1..N-1 of a group across hosts, following its rank 0;
- ``group``: a tensor-parallel worker group: its other ranks' program and its KV side channel.
"""
