"""API keys on the public APIs: ``Authorization: Bearer KEY`` on HTTP, the ``authorization``
metadata (``Bearer KEY``) on gRPC.

Keys are compared in constant time (``hmac.compare_digest``, against every key, so the time
says nothing about which key nearly matched) and never logged or echoed. Health checks stay
open: a load balancer probes without a key. With ``salt_from_key`` each key's requests run
under a prefix-cache salt of their own (``cache_salt``).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health

from pdserve.frontend.cache_salt import key_salt
from pdserve.frontend.rate_limit import RateLimiter

_SCHEME = "bearer"
# gRPC methods open to anyone: the health service's (Check, Watch).
_OPEN_PREFIXES = (f"/{health.SERVICE_NAME}/",)


class ApiKeys:
    """The keys a client must present; without any, everything is allowed. ``salt_from_key``:
    each key has a prefix-cache salt of its own (``cache_salt.key_salt``)."""

    def __init__(self, keys: Sequence[str], salt_from_key: bool = False) -> None:
        self._keys = [key.encode() for key in keys]
        self._salts = {f"key-{index}": key_salt(key) for index, key in enumerate(keys)} if salt_from_key else {}

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def identify(self, authorization: str | None) -> str | None:
        """Which key an ``Authorization`` value (``Bearer KEY``) carries, as ``key-N`` (its
        position; never the key itself): the client's rate-limit bucket. ``""`` when no keys
        are required, every client alike whatever it sends; None when it carries no key."""
        if not self._keys:
            return ""
        if authorization is None:
            return None
        scheme, _, given = authorization.strip().partition(" ")
        candidate = given.strip().encode(errors="surrogateescape")
        matched = -1
        for index, key in enumerate(self._keys):  # every key, always: no early exit to time
            if hmac.compare_digest(candidate, key):
                matched = index
        return f"key-{matched}" if matched >= 0 and scheme.lower() == _SCHEME else None

    def cache_salt(self, identity: str | None) -> str | None:
        """The prefix-cache salt of the key ``identify`` named; None when salts are not derived
        from keys (or no key was given)."""
        return self._salts.get(identity) if identity else None

    def allows(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` value (``Bearer KEY``) carries one of the keys."""
        return self.identify(authorization) is not None

    @staticmethod
    def problem(authorization: str | None) -> str:
        """What a refused client is told (never the key it sent)."""
        if authorization is None:
            return "missing API key: send the header 'Authorization: Bearer KEY'"
        return "invalid API key"


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every gRPC call but the health checks with UNAUTHENTICATED unless its
    ``authorization`` metadata carries a key, and with RESOURCE_EXHAUSTED past the key's
    rate when there is a ``limiter``."""

    def __init__(self, keys: ApiKeys, limiter: RateLimiter | None = None) -> None:
        self.keys = keys
        self.limiter = limiter

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(_OPEN_PREFIXES):
            return handler
        authorization = dict(details.invocation_metadata or ()).get("authorization")
        if isinstance(authorization, bytes):
            authorization = authorization.decode(errors="replace")
        bucket = self.keys.identify(authorization)
        if bucket is None:
            return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED, ApiKeys.problem(authorization))
        wait_s = self.limiter.acquire(bucket) if self.limiter is not None else 0.0
        if wait_s > 0:
            return _refusal(handler, grpc.StatusCode.RESOURCE_EXHAUSTED, RateLimiter.problem(wait_s))
        return handler


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that ends the call with ``code``."""

    async def refuse(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    async def refuse_stream(request: object, context: grpc.aio.ServicerContext):  # an async generator, as
        await context.abort(code, message)  # streaming handlers must be
        yield  # never reached: abort raises

    codecs = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse, **codecs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **codecs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse, **codecs)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, **codecs)
