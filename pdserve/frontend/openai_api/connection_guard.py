"""Limits on the HTTP server's connections that uvicorn does not have: a deadline for each
request's headers, and a cap on the connections open from one client address.

uvicorn's ``timeout_keep_alive`` closes a connection idle between requests, but one that
trickles its headers a byte at a time is never idle, and holds its connection (and a file
descriptor) for as long as it likes; many such connections starve the server. Here a
connection must deliver each request's headers within ``header_timeout_s`` of its first byte
(of the connection, for the first request), or it is closed. A client address that already
has ``max_per_client`` connections open gets a 429 and its new connection closed at once.

``GuardedH11Protocol`` is uvicorn's h11 protocol (the one its "auto" choice takes without
httptools, which pdserve does not install) with those two checks; the server hands uvicorn
``guard.protocol`` as its ``http`` class.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


class ConnectionGuard:
    """What the server's connections share: the limits and the open connections per address.

    ``header_timeout_s``: seconds a request's headers may take to arrive; ``max_per_client``:
    connections one address may hold open (None: no cap).
    """

    def __init__(self, header_timeout_s: float, max_per_client: int | None) -> None:
        self.header_timeout_s = header_timeout_s
        self.max_per_client = max_per_client
        self.open: dict[str, int] = {}  # client address -> its connections open now

    def protocol(self, **kwargs: Any) -> GuardedH11Protocol:
        """A new connection's protocol (uvicorn calls this with its own keywords)."""
        return GuardedH11Protocol(guard=self, **kwargs)

    def admit(self, address: str) -> bool:
        """Count a new connection from ``address``; False (not counted) past the cap."""
        count = self.open.get(address, 0)
        if self.max_per_client is not None and count >= self.max_per_client:
            return False
        self.open[address] = count + 1
        return True

    def leave(self, address: str) -> None:
        count = self.open.pop(address, 0) - 1
        if count > 0:
            self.open[address] = count


class GuardedH11Protocol(H11Protocol):
    def __init__(self, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.guard = guard
        self._address: str | None = None  # counted against this address while open
        self._header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        address = self.client[0] if self.client else ""
        if not self.guard.admit(address):
            limit = self.guard.max_per_client
            body = f"too many connections from {address}: the limit (max_connections_per_client) is {limit}\n"
            transport.write(
                b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
                + f"content-length: {len(body)}\r\n\r\n{body}".encode()
            )
            transport.close()
            return
        self._address = address
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._address is not None:
            self.guard.leave(self._address)
            self._address = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._header_deadline is None:
            self._arm()  # the first byte of a request after the last response: its headers' clock starts
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm()  # the headers are in

    def _arm(self) -> None:
        self._disarm()
        self._header_deadline = self.loop.call_later(self.guard.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_late(self) -> None:
        self._header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            logger.info(
                "closed a connection from %s: no request headers within %g s",
                self._address,
                self.guard.header_timeout_s,
            )
            self.transport.close()
