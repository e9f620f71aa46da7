"""A handler ended by a cancellation nobody asked for answers INTERNAL, not nothing.

grpc.aio takes a ``CancelledError`` out of a handler for the call's own cancellation, and
sends no status: the client then waits for its deadline. One can also come from inside. A
client call that the handler awaits, cut because its channel was closed, raises
``CancelledError`` in the awaiting task although nobody cancelled that task. ``CancellationGuard``
tells the two apart by the task's ``cancelling()`` count, lets a real cancellation through,
and ends the other kind with INTERNAL, logged with its traceback. Code that expects such a cut
handles it where it happens (the frontend's ``unavailable_if_closed``); this is the net under
the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import grpc

logger = logging.getLogger(__name__)

Unary = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
Streaming = Callable[[Any, grpc.aio.ServicerContext], AsyncGenerator[Any, None]]


class CancellationGuard(grpc.aio.ServerInterceptor):
    """Wraps each unary-unary handler and each unary-stream async generator (the shapes
    pdserve's services use); other handlers pass as they are."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        if inspect.iscoroutinefunction(handler.unary_unary):
            return handler._replace(unary_unary=_guard_unary(handler.unary_unary, details.method))
        if inspect.isasyncgenfunction(handler.unary_stream):
            return handler._replace(unary_stream=_guard_stream(handler.unary_stream, details.method))
        return handler


def _is_stray() -> bool:
    """Whether the CancelledError being handled reached a task that nobody cancelled."""
    task = asyncio.current_task()
    return task is not None and not task.cancelling()


def _internal(method: str) -> str:
    logger.exception("%s: cancelled from inside (a call it awaited was cut)", method)
    return f"{method} was cut short: a call it awaited was cancelled"


def _guard_unary(behavior: Unary, method: str) -> Unary:
    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except asyncio.CancelledError:
            if not _is_stray():
                raise
            await context.abort(grpc.StatusCode.INTERNAL, _internal(method))

    return guarded


def _guard_stream(behavior: Streaming, method: str) -> Streaming:
    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> AsyncGenerator[Any, None]:
        try:
            # Closed here, not by the garbage collector: its clean-up (an abort) runs at once.
            async with contextlib.aclosing(behavior(request, context)) as responses:
                async for response in responses:
                    yield response
        except asyncio.CancelledError:
            if not _is_stray():
                raise
            await context.abort(grpc.StatusCode.INTERNAL, _internal(method))

    return guarded
