"""The frontend: the public gRPC and OpenAI HTTP APIs, request validation, and the router.

- ``main``: ``serve``, the frontend process: watch the registry, serve both public APIs;
- ``config``: ``FrontendConfig`` and ``RouterConfig``, the frontend's options;
- ``service``: ``InferenceService``, the public gRPC ``Inference`` service, an adapter over the ``Gateway``;
- ``openai_api``: the OpenAI-compatible HTTP API, the other adapter over the ``Gateway``;
- ``gateway``: ``Gateway``, the one request path behind both APIs: admit, validate, run the flow, record;
- ``auth``: ``ApiKeys``, the API keys both public APIs check, in constant time;
- ``cache_salt``: ``key_salt`` and ``combine``, the prefix-cache salt a request runs under (its own, its key's);
- ``rate_limit``: ``RateLimiter``, a token bucket of request rates per API key;
- ``catalog``: ``ModelCatalog``, the models served and the checks a request passes before routing;
- ``char_budget``: ``CharBudget``, the prompt characters tokenized at once across requests;
- ``routing``: ``Routing``, what every flow shares: registry view, router, channels, migration limits;
- ``router``: ``Router``, which prefill worker (or none) and which decode worker serve a request;
- ``groups``: ``available``, the workers a new request may go to, a data-parallel group one failure domain;
- ``kv_fit``: ``kv_misfit``, whether a prefill worker's KV can move to a decode worker at all;
- ``prefix_index``: ``PrefixIndex``, which prompt prefixes each prefill worker probably has cached;
- ``channels``: ``WorkerChannels``, one gRPC channel per worker, and ``unavailable_if_closed``;
- ``flow``: ``RequestFlow``, one request's way through the workers, migrations included;
- ``attempt``: ``Attempt``, one try at a request, and how a try ends short (``Broken``, ``FlowError``);
- ``prefill_step``: ``PrefillStep``, an attempt's Prefill call, retried once, and the ``release`` of its pins;
- ``text_stream``: ``TextStream``, token ids in, text out, with the request's stop strings;
- ``flow_report``: ``FlowReport``, the latency breakdown, cached prompt tokens and token times a final message carries.
"""
