"""The step core: requests in, one model step at a time, tokens out. It knows nothing of roles.

- ``engine``: ``LLMEngine``, which adds requests, steps them and reports their outputs;
- ``output``: ``RequestOutput`` and ``StepOutput``, and the token-level rules that end a request;
- ``request_limits``: which prompts (and resumed requests) the engine can serve;
- ``startup``: what the engine works out as it starts: KV cache memory, EOS ids, warm-up prompt;
- ``engine_loop``: the engine on its own thread, fed and drained from asyncio;
- ``engine_thread``: that thread: commands between steps, idle waits, lockstep, the admitter;
- ``heartbeat``: the engine thread's sign of progress, read by liveness checks from other threads;
- ``scheduler``: which requests run in a step, within the token and sequence budgets;
- ``block_pool``: KV blocks, their reference counts and the prefix cache;
- ``kv_cache_manager``: a request's blocks, allocated and freed through the pool;
- ``pins``: blocks held for a peer to pull, each with a deadline;
- ``request``: one request's state in the engine;
- ``model_runner``: one step's inputs built, the model run, across ranks;
- ``step_plan``: what rank 0 sends its followers for each step;
- ``sampler``: the next token of every row, with penalties and logprobs;
- ``grammar_mask``: structured outputs' token bitmask, applied to the batch's constrained rows.
"""
