"""The choices of one OpenAI request on the ``Gateway``: admitted together, streamed together.

A completion request of P prompts and ``n`` choices is P x n gateway requests, each with its
own flow, exactly as P x n gRPC calls would be. They are admitted before anything is sent, so
that a refusal of any gets its HTTP status; their messages are then merged as they come,
tagged with the choice's index. Closing the merged stream (the client left) closes every
choice's stream, which cancels its flow and frees its blocks on the workers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing

from starlette.requests import Request

from pdserve.frontend.attempt import FlowError
from pdserve.frontend.gateway import Admitted, Gateway, Rejected
from pdserve.frontend.openai_api.errors import ApiError
from pdserve.v1 import inference_pb2

Event = tuple[int, inference_pb2.GenerateResponse]
_BUFFERED_MESSAGES = 16  # per choice, between its flow and the client


async def admit_all(
    gateway: Gateway,
    requests: Sequence[inference_pb2.GenerateRequest],
    *,
    add_special_tokens: bool = True,
    fill_context: bool = False,
    key_salt: str | None = None,
) -> list[Admitted]:
    """Every request admitted, or none (ApiError with the refusal's status); the keywords:
    ``Gateway.admit``'s."""
    admitted: list[Admitted] = []
    try:
        for request in requests:
            admitted.append(
                await gateway.admit(
                    request, None, add_special_tokens=add_special_tokens, fill_context=fill_context, key_salt=key_salt
                )
            )
    except BaseException as exc:
        for each in admitted:
            each.release()
        if isinstance(exc, Rejected):
            raise ApiError.from_grpc(exc.code, exc.message) from None
        raise
    return admitted


async def merged(admitted: Sequence[Admitted]) -> AsyncGenerator[Event, None]:
    """Every choice's messages as they come; a choice's FlowError (or any error) ends them all."""
    # Bounded: a client that stops reading stops its flows, as gRPC's flow control does.
    queue: asyncio.Queue[tuple[int, inference_pb2.GenerateResponse | None, Exception | None]] = asyncio.Queue(
        maxsize=_BUFFERED_MESSAGES * len(admitted)
    )

    async def pump(index: int, choice: Admitted) -> None:
        try:
            async with aclosing(choice.responses()) as stream:
                async for response in stream:
                    await queue.put((index, response, None))
        except Exception as exc:  # a FlowError, or a bug: either way the reader raises it
            await queue.put((index, None, exc))
            return
        await queue.put((index, None, None))

    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(pump(index, choice)) for index, choice in enumerate(admitted)]
    try:
        running = len(tasks)
        while running:
            index, response, error = await queue.get()
            if error is not None:
                raise error
            if response is None:
                running -= 1
            else:
                yield index, response
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for choice in admitted:  # one whose task was cancelled before its stream began
            choice.release()


async def first_event(events: AsyncGenerator[Event, None]) -> Event:
    """The first message, so that a failure before any (no worker) still gets its status."""
    try:
        return await anext(events)
    except FlowError as exc:
        await events.aclose()
        raise ApiError.from_grpc(exc.code, exc.message) from None
    except StopAsyncIteration:
        raise ApiError(500, "the request ended without a message") from None


async def collect_unless_disconnected(request: Request, events: AsyncGenerator[Event, None]) -> list[Event]:
    """Every message, read while watching the client: one that leaves ends the request (its
    blocks freed) and raises ``ClientGone``."""

    async def collect() -> list[Event]:
        async with aclosing(events):
            return [event async for event in events]

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    loop = asyncio.get_running_loop()
    work, watch = loop.create_task(collect()), loop.create_task(disconnected())
    try:
        await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, watch):
            task.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
    if not work.cancelled() and work.done():
        try:
            return work.result()
        except FlowError as exc:
            raise ApiError.from_grpc(exc.code, exc.message) from None
    raise ClientGone()


class ClientGone(Exception):
    """The client disconnected before its response was ready."""
