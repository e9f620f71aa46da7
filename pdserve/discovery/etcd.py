"""Reaching etcd: parse its URL, open an aetcd client that is known to answer, share it.

aetcd's own ``connect()`` only builds a gRPC channel and never talks to the server, and its
calls have no deadline unless one is given; a server that accepts connections but never
answers would hang them forever. So :func:`connect` probes the server with one read under a
deadline, and every caller in pdserve wraps each aetcd call in ``asyncio.timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import aetcd

DEFAULT_PORT = 2379

# What a failed etcd call raises: aetcd maps gRPC errors to ClientError subclasses
# (ConnectionFailedError when nothing listens, ConnectionTimeoutError past the gRPC deadline);
# asyncio.timeout raises TimeoutError past ours.
ETCD_ERRORS: tuple[type[Exception], ...] = (aetcd.exceptions.ClientError, TimeoutError)

# Each client dials on its own: by default gRPC shares a process's connections to one address
# among its channels, so a new client to an etcd that just came back inherited the old
# channel's failure and its reconnect back-off ("Connection refused" for seconds).
_CHANNEL_OPTIONS = {"grpc.use_local_subchannel_pool": 1}

# Any key does for the probe: a read of a missing key is the cheapest round trip etcd serves.
_PROBE_KEY = b"/pdserve/probe"


# Longest wait for one etcd call: short enough that a hung call cannot outlive a lease.
MAX_CALL_TIMEOUT_S = 2.0
# Retry pacing while etcd is away: quick first retries, then about once a second.
MIN_BACKOFF_S = 0.2
MAX_BACKOFF_S = 1.0


class RegistryUnavailable(RuntimeError):
    """etcd could not be reached (or did not answer) within the deadline."""


@dataclass(frozen=True)
class EtcdEndpoint:
    """One etcd client endpoint: ``http://host:port``, ``host:port`` or ``host`` (port 2379)."""

    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> EtcdEndpoint:
        """Parse an etcd URL; anything but plain http to one host is a ValueError naming it."""
        text = url.strip()
        parts = urlsplit(text if "://" in text else f"http://{text}")
        try:
            port = parts.port
        except ValueError as exc:  # a port that is not a number or out of range
            raise ValueError(f"bad etcd URL {url!r}: {exc}") from None
        if parts.scheme != "http":
            raise ValueError(f"bad etcd URL {url!r}: only http:// is supported (no TLS)")
        if not parts.hostname or parts.username or parts.password:
            raise ValueError(f"bad etcd URL {url!r}: expected http://HOST:PORT")
        if parts.path not in ("", "/") or parts.query or parts.fragment or "," in text:
            raise ValueError(f"bad etcd URL {url!r}: expected one endpoint, http://HOST:PORT")
        return cls(host=parts.hostname, port=port if port is not None else DEFAULT_PORT)

    @property
    def url(self) -> str:
        """The canonical form, ``http://host:port``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


async def connect(url: str, timeout_s: float = 3.0) -> aetcd.Client:
    """An aetcd client to the etcd at ``url`` that has answered one read.

    Raises ValueError for a malformed URL, and RegistryUnavailable within ``timeout_s`` when
    the server refuses, does not answer, or errs. The client's own per-call gRPC deadline is
    ``timeout_s`` too, a second guard under the callers' ``asyncio.timeout``.
    """
    endpoint = EtcdEndpoint.parse(url)
    client = aetcd.Client(endpoint.host, endpoint.port, timeout=timeout_s, options=_CHANNEL_OPTIONS)
    try:
        async with asyncio.timeout(timeout_s):
            await client.get(_PROBE_KEY)
    except ETCD_ERRORS as exc:
        await close_quietly(client, timeout_s)
        reason = str(exc) or f"no answer within {timeout_s:g} s"
        raise RegistryUnavailable(f"etcd at {url} is unreachable: {reason}") from exc
    return client


async def close_quietly(client: aetcd.Client, timeout_s: float = 1.0) -> None:
    """Close a client, giving up after ``timeout_s``: closing a dead channel must not block."""
    try:
        async with asyncio.timeout(timeout_s):
            await client.close()
    except (*ETCD_ERRORS, OSError):
        pass


class EtcdConnection:
    """One client to etcd that the parts of a process share; whoever made it closes it, last.

    The client is opened on first use (``connect``, under ``timeout_s``) and dropped when a
    call on it fails, so that the next use dials afresh: after an outage gRPC's reconnect
    backoff on an old channel can grow to minutes, while a new channel dials at once. A
    dropped client is closed when the last call on it ends, not at once: closing a channel
    cancels the calls on it, and one part's failure must not cancel another part's call.
    """

    def __init__(self, url: str, timeout_s: float = MAX_CALL_TIMEOUT_S) -> None:
        EtcdEndpoint.parse(url)  # a malformed URL fails here, not at first use
        self.url = url
        self.timeout_s = timeout_s
        self._client: aetcd.Client | None = None
        self._num_calls: dict[aetcd.Client, int] = {}  # uses under way, of the client and of dropped ones
        self._connecting = asyncio.Lock()  # one dial at a time: a second would leak the first's client

    @contextlib.asynccontextmanager
    async def use(self) -> AsyncIterator[aetcd.Client]:
        """The client, for calls each under its own deadline (inside the block, so that a
        deadline passed counts as a failure); a failed call drops the client.

        Raises RegistryUnavailable when there is no client and none can be opened.
        """
        client = await self._open()
        self._num_calls[client] = self._num_calls.get(client, 0) + 1
        try:
            yield client
        except ETCD_ERRORS:
            if self._client is client:
                self._client = None
            raise
        finally:
            self._num_calls[client] -= 1
            if not self._num_calls[client]:
                del self._num_calls[client]
                if client is not self._client:
                    await close_quietly(client)

    async def close(self) -> None:
        """Close the client; for the owner, once nothing uses the connection any more."""
        client, self._client = self._client, None
        if client is not None:
            await close_quietly(client)

    async def _open(self) -> aetcd.Client:
        async with self._connecting:
            if self._client is None:
                self._client = await connect(self.url, self.timeout_s)
            return self._client
