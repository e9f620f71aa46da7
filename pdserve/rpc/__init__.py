"""What every pdserve gRPC server and client shares: server set-up, wire conversions.

- ``server``: ``RpcServer``, a grpc.aio server with health checking and reflection;
- ``tls``: ``ServerTLS``, ``ClientTLS`` and ``ClusterTLS``, TLS settings as configuration structs;
- ``admin``: ``AdminPolicy``, who may call an administrative RPC: an mTLS peer or the admin key;
- ``cancellation``: ``CancellationGuard``, a handler cut by a cancellation nobody asked for answers INTERNAL;
- ``status``: ``refuse`` and ``refusal_reason``, refusals typed in the call's trailing metadata;
- ``sampling``: ``sampling_params``, ``SamplingOptions`` on the wire to the engine's ``SamplingParams``;
- ``logprobs``: ``token_logprobs``, the engine's per-token ``Logprobs`` on the wire (``TokenLogprobs``);
- ``kv_source``: ``ready_source``, the ``KVSource`` telling a decode worker where a prompt's KV is.
"""
