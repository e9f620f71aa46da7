"""Light types that cross process boundaries: they import msgspec and the standard library only.

The frontend, the CLI's server-facing commands, the registry, the planner and the operator read
these without loading torch; the engine and the workers build on them.

- ``engine_config``: ``EngineConfig``, the engine's options and their one set of defaults
  (``MAX_NUM_SEQS``, ``MAX_NUM_BATCHED_TOKENS``, the dtype and kernel choices);
- ``engine_load``: ``EngineLoad``, an engine's occupancy after a step (registry entries, metrics);
- ``sampling_params``: ``SamplingParams``, how one request's tokens are picked, checked once;
- ``structured_output``: ``StructuredOutput``, the JSON schema, regex, choice or grammar an output must match;
- ``logprobs``: ``Logprobs``, a sampled token's logprob and the top-n alternatives;
- ``cache_salt``: ``salt_root``, where a tenant's ``cache_salt`` starts its prompts' chain of block hashes;
- ``duration``: ``parse_duration``, the one grammar of durations (``500ms``, ``2s``, ``1m``), standard library only.
"""
