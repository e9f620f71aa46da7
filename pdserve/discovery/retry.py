"""Outliving etcd's outages: retry a start-up call until a deadline, and log an outage once.

Every part of pdserve that keeps something in etcd, or reads from it, does the same two
things: at start-up it retries its first call, with a short backoff, until a deadline, and
then fails naming the URL (``retry_until``); afterwards, in its background loop, it keeps
retrying while saying so once when etcd goes away and, where that helps an operator, once
when it comes back (``Outage``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from pdserve.discovery.etcd import (
    ETCD_ERRORS,
    MAX_BACKOFF_S,
    MIN_BACKOFF_S,
    EtcdConnection,
    RegistryUnavailable,
    describe_etcd_error,
)

T = TypeVar("T")

# What a call through an EtcdConnection raises when etcd is away: a failed call, or no client.
UNAVAILABLE: tuple[type[Exception], ...] = (*ETCD_ERRORS, RegistryUnavailable)


async def retry_until(
    etcd: EtcdConnection,
    attempt: Callable[[], Awaitable[T]],
    timeout_s: float,
    *,
    min_backoff_s: float = MIN_BACKOFF_S,
    max_backoff_s: float = MAX_BACKOFF_S,
) -> T:
    """``attempt()``'s result, retrying it while etcd is unavailable for up to ``timeout_s``.

    Retries wait ``min_backoff_s``, doubling up to ``max_backoff_s``. Raises
    RegistryUnavailable naming ``etcd.url`` (and the last failure) when the next retry would
    begin past the deadline; anything else ``attempt`` raises goes straight to the caller.
    """
    deadline = time.monotonic() + timeout_s
    backoff = min_backoff_s
    while True:
        try:
            return await attempt()
        except UNAVAILABLE as exc:
            if time.monotonic() + backoff > deadline:
                raise RegistryUnavailable(describe_etcd_error(etcd.url, exc)) from exc
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, max_backoff_s)


class Outage:
    """Whether a loop's last call to etcd failed, so that an outage is logged once.

    ``failed`` logs a warning when an outage begins (an unexpected exception with its
    traceback), nothing while it lasts; ``answered`` logs, if given a message, when it ends.
    While it lasts, ``backoff_s`` paces the retries: it doubles at each failure, from
    ``min_backoff_s`` to ``max_backoff_s``.
    """

    def __init__(
        self, logger: logging.Logger, *, min_backoff_s: float = MIN_BACKOFF_S, max_backoff_s: float = MAX_BACKOFF_S
    ) -> None:
        self._logger = logger
        self._min_backoff_s = min_backoff_s
        self._max_backoff_s = max_backoff_s
        self.is_out = False
        self.backoff_s = min_backoff_s

    def failed(self, exc: BaseException, message: str, *args: object) -> None:
        """A call failed with ``exc``: log ``message % args`` and the error if this begins an outage."""
        if not self.is_out:
            expected = isinstance(exc, UNAVAILABLE)
            self._logger.warning(f"{message}: %s", *args, exc, exc_info=None if expected else exc)
        self.is_out = True
        self.backoff_s = min(2 * self.backoff_s, self._max_backoff_s)

    def answered(self, message: str | None = None, *args: object) -> None:
        """A call succeeded: log ``message % args``, if given, when this ends an outage."""
        if self.is_out and message is not None:
            self._logger.info(message, *args)
        self.is_out = False
        self.backoff_s = self._min_backoff_s
