"""The OpenAI-compatible HTTP API: an adapter over the frontend's ``Gateway``, as the gRPC service is.

- ``server``: ``HttpServer``, uvicorn run on the frontend's own event loop beside grpc.aio;
- ``connection_guard``: ``ConnectionGuard``, a deadline for request headers and a cap on connections per address;
- ``app``: ``create_app``, the Starlette app: its routes, API keys, rate limits, body limit and errors;
- ``endpoints``: ``completions`` and ``chat_completions``: a body in, the gateway's requests, a body out;
- ``protocol``: ``CompletionRequest`` and ``ChatRequest``, and the ``GenerateRequest`` each choice becomes;
- ``structured``: a request's structured output from ``response_format`` or vLLM's ``guided_*`` fields;
- ``tools``: ``tool_plan``, a request's tools and ``tool_choice``: forced calls enforced, outputs read as calls;
- ``choices``: ``admit_all`` and ``merged``, a request's choices admitted together and streamed together;
- ``output``: ``Output``, the response bodies and streamed chunks built from the gateway's messages;
- ``logprobs``: ``ChoiceLogprobs``, OpenAI's ``logprobs`` objects from the streamed ``TokenLogprobs``;
- ``errors``: ``ApiError``, errors in OpenAI's JSON shape with the HTTP status matching the gRPC one.
"""
