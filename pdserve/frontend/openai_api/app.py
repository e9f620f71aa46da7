"""The OpenAI-compatible HTTP API as a Starlette app over the frontend's ``Gateway``.

Routes: ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/completions``,
``POST /v1/chat/completions`` and ``GET /health``. Every ``/v1`` route needs an API key when the
frontend has any (``Authorization: Bearer KEY``) and counts against the key's rate limit, if
one is set (429 with ``Retry-After``); ``/health`` stays open. A body past
``max_request_bytes`` is refused with 413 before it is read whole. Every failure answers in
OpenAI's error shape (``errors.ApiError``); an unexpected one is logged and answers 500 with
its message, and the server stays up.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pdserve.frontend.auth import ApiKeys
from pdserve.frontend.gateway import Gateway
from pdserve.frontend.openai_api.choices import ClientGone
from pdserve.frontend.openai_api.endpoints import ChatTemplates, chat_completions, completions
from pdserve.frontend.openai_api.errors import ApiError
from pdserve.frontend.rate_limit import RateLimiter

logger = logging.getLogger(__name__)

Handler = Callable[[Request, bytes], Awaitable[Response]]


def create_app(
    gateway: Gateway,
    keys: ApiKeys,
    limiter: RateLimiter | None = None,
    is_serving: Callable[[], bool] = lambda: True,
) -> Starlette:
    """The app; ``limiter`` bounds each key's request rate; ``is_serving`` turns ``/health``
    to 503 while the frontend drains."""
    limit = gateway.config.max_request_bytes
    templates = ChatTemplates(gateway.config.tokenizer)

    def endpoint(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            try:
                authorization = request.headers.get("authorization")
                bucket = keys.identify(authorization)
                if bucket is None:
                    raise ApiError(401, ApiKeys.problem(authorization), code="invalid_api_key")
                request.state.key_salt = keys.cache_salt(bucket)
                wait_s = limiter.acquire(bucket) if limiter is not None else 0.0
                if wait_s > 0:
                    return ApiError(429, RateLimiter.problem(wait_s), code="rate_limit_exceeded").response(
                        headers={"Retry-After": str(math.ceil(wait_s))}
                    )
                return await handler(request, await _body(request, limit))
            except ApiError as exc:
                return exc.response()
            except (ClientGone, ClientDisconnect):
                return Response(status_code=499)  # nobody reads it: the client left
            except Exception as exc:
                logger.exception("%s %s failed", request.method, request.url.path)
                return ApiError(500, f"internal error: {type(exc).__name__}: {exc}").response()

        return run

    async def list_models(request: Request, body: bytes) -> Response:
        return JSONResponse({"object": "list", "data": [_model_card(m) for m in gateway.models().values()]})

    async def get_model(request: Request, body: bytes) -> Response:
        name = request.path_params["name"]
        models = gateway.models()
        if name not in models:
            raise ApiError(
                404,
                f"model {name!r} is not served here; served: {sorted(models)}",
                param="model",
                code="model_not_found",
            )
        return JSONResponse(_model_card(models[name]))

    async def completion(request: Request, body: bytes) -> Response:
        return await completions(gateway, request, body)

    async def chat(request: Request, body: bytes) -> Response:
        return await chat_completions(gateway, templates, request, body)

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok" if is_serving() else "draining"}, status_code=200 if is_serving() else 503)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}").response()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", endpoint(list_models), methods=["GET"]),
        Route("/v1/models/{name:path}", endpoint(get_model), methods=["GET"]),
        Route("/v1/completions", endpoint(completion), methods=["POST"]),
        Route("/v1/chat/completions", endpoint(chat), methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})


async def _body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 past ``limit`` bytes (by its Content-Length, or as it arrives)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is {declared} bytes, past the limit (max_request_bytes) of {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body is past the limit (max_request_bytes) of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _model_card(model) -> dict[str, object]:
    return {
        "id": model.name,
        "object": "model",
        "created": 0,
        "owned_by": "pdserve",
        "max_model_len": model.max_model_len,
    }
