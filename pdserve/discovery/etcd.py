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

from pdserve.discovery.etcd_auth import EtcdAuth

DEFAULT_PORT = 2379

# What a failed etcd call raises: aetcd maps gRPC errors to ClientError subclasses
# (ConnectionFailedError when nothing listens, ConnectionTimeoutError past the gRPC deadline);
# asyncio.timeout raises TimeoutError past ours.
ETCD_ERRORS: tuple[type[Exception], ...] = (aetcd.exceptions.ClientError, TimeoutError)

# A read of a missing key is the cheapest round trip etcd serves. This one lies in the live
# knobs' range, which every pdserve component may read where etcd's auth is on (README:
# Security): a refusal of the probe is then a refusal of the credentials.
_PROBE_KEY = b"/pdserve/v1/knobs/"


# Longest wait for one etcd call: short enough that a hung call cannot outlive a lease.
MAX_CALL_TIMEOUT_S = 2.0
# Retry pacing while etcd is away: quick first retries, then about once a second.
MIN_BACKOFF_S = 0.2
MAX_BACKOFF_S = 1.0


class RegistryUnavailable(RuntimeError):
    """etcd could not be reached (or did not answer) within the deadline, or refused the credentials."""


# What etcd says when it refuses a request for its credentials (etcd's own auth), and what a
# failed TLS handshake looks like from the client.
_REFUSALS = ("permission denied", "user name", "authentication failed", "invalid auth token", "auth: ")
_HANDSHAKE = ("ssl", "handshake", "certificate", "tls", "tsi_", "verification")


def describe_etcd_error(url: str, error: Exception) -> str:
    """One line for a failed etcd call: unreachable, refused (auth), or a TLS failure, with the fix."""
    text = str(error) or f"no answer within {MAX_CALL_TIMEOUT_S:g} s"
    lowered = text.lower()
    if any(word in lowered for word in _REFUSALS):
        return (
            f"etcd at {url} refused the request: {text} (give an etcd user with --etcd-user/--etcd-password "
            "or $PDSERVE_ETCD_USER/$PDSERVE_ETCD_PASSWORD, or a client certificate with --etcd-cert/--etcd-key, "
            "whose role grants this; README: Security)"
        )
    if any(word in lowered for word in _HANDSHAKE):
        return (
            f"etcd at {url}: TLS failed: {text} (check --etcd-cacert, and --etcd-cert/--etcd-key where etcd "
            "requires client certificates)"
        )
    return f"etcd at {url} is unreachable: {text}"


@dataclass(frozen=True)
class EtcdEndpoint:
    """One etcd client endpoint: ``http://host:port``, ``https://host:port`` (TLS), ``host:port``
    or ``host`` (port 2379)."""

    host: str
    port: int
    tls: bool = False

    @classmethod
    def parse(cls, url: str) -> EtcdEndpoint:
        """Parse an etcd URL; anything but http or https to one host is a ValueError naming it."""
        text = url.strip()
        parts = urlsplit(text if "://" in text else f"http://{text}")
        try:
            port = parts.port
        except ValueError as exc:  # a port that is not a number or out of range
            raise ValueError(f"bad etcd URL {url!r}: {exc}") from None
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"bad etcd URL {url!r}: expected http:// or https:// (TLS)")
        if not parts.hostname or parts.username or parts.password:
            raise ValueError(f"bad etcd URL {url!r}: expected http://HOST:PORT")
        if parts.path not in ("", "/") or parts.query or parts.fragment or "," in text:
            raise ValueError(f"bad etcd URL {url!r}: expected one endpoint, http://HOST:PORT")
        return cls(host=parts.hostname, port=port if port is not None else DEFAULT_PORT, tls=parts.scheme == "https")

    @property
    def url(self) -> str:
        """The canonical form, ``http://host:port`` (``https://`` with TLS)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"


def check_url(url: str, auth: EtcdAuth) -> EtcdEndpoint:
    """The endpoint of ``url``; ValueError for a malformed URL or TLS options on an http:// one."""
    endpoint = EtcdEndpoint.parse(url)
    if auth.tls is not None and not endpoint.tls:
        raise ValueError(f"etcd URL {url!r}: TLS options (--etcd-cacert, --etcd-cert, --etcd-key) need an https:// URL")
    return endpoint


async def connect(url: str, timeout_s: float = 3.0, auth: EtcdAuth = EtcdAuth()) -> aetcd.Client:
    """An aetcd client to the etcd at ``url`` that has answered one read, over TLS for an
    ``https://`` URL, as ``auth``'s user or client certificate.

    Raises ValueError for a malformed URL or a TLS file that is missing or bad, and
    RegistryUnavailable within ``timeout_s`` when the server refuses (the connection or the
    credentials), does not answer, or errs. The client's own per-call gRPC deadline is
    ``timeout_s`` too, a second guard under the callers' ``asyncio.timeout``.
    """
    endpoint = check_url(url, auth)
    client = auth.client(endpoint.host, endpoint.port, use_tls=endpoint.tls, timeout_s=timeout_s)
    try:
        async with asyncio.timeout(timeout_s):
            await client.get(_PROBE_KEY)
    except aetcd.exceptions.ClientError as exc:
        await close_quietly(client, timeout_s)
        raise RegistryUnavailable(describe_etcd_error(url, exc)) from exc
    except TimeoutError as exc:
        await close_quietly(client, timeout_s)
        raise RegistryUnavailable(f"etcd at {url} is unreachable: no answer within {timeout_s:g} s") from exc
    return client


async def close_quietly(client: aetcd.Client, timeout_s: float = 1.0) -> None:
    """Close a client, giving up after ``timeout_s``: closing a dead channel must not block."""
    try:
        async with asyncio.timeout(timeout_s):
            await client.close()
    except ETCD_ERRORS + (OSError,):
        pass


class EtcdConnection:
    """One client to etcd that the parts of a process share; whoever made it closes it, last.

    The client is opened on first use (``connect``, under ``timeout_s``) and dropped when a
    call on it fails, so that the next use dials afresh: after an outage gRPC's reconnect
    backoff on an old channel can grow to minutes, while a new channel dials at once. A
    dropped client is closed when the last call on it ends, not at once: closing a channel
    cancels the calls on it, and one part's failure must not cancel another part's call.
    """

    def __init__(self, url: str, timeout_s: float = MAX_CALL_TIMEOUT_S, auth: EtcdAuth = EtcdAuth()) -> None:
        check_url(url, auth)  # a malformed URL fails here, not at first use
        self.url = url
        self.timeout_s = timeout_s
        self.auth = auth
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
                self._client = await connect(self.url, self.timeout_s, self.auth)
            return self._client
