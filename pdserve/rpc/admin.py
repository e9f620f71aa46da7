"""Who may call an administrative RPC (a worker's ``Drain``): an mTLS peer, or a caller with
the admin key.

A server that requires client certificates from the cluster CA (``ClusterTLS``) has already
verified every peer in the TLS handshake; its ``auth_context`` then names the peer's
certificate. Without cluster TLS, the caller must send ``authorization: Bearer KEY`` metadata
with the server's admin key, compared in constant time. A server with neither is an unsecured
deployment, and the RPC is open (the process says so at start).
"""

from __future__ import annotations

import hmac

import grpc

AUTHORIZATION = "authorization"
_BEARER = "Bearer "


def admin_metadata(admin_key: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries ``admin_key`` (none without one)."""
    return () if admin_key is None else ((AUTHORIZATION, f"{_BEARER}{admin_key}"),)


class AdminPolicy:
    """Attributes:
    admin_key: the key an administrative call must carry, or None.
    verified_peers: whether the server verifies client certificates against a CA it trusts
        (mTLS); only then does a peer's certificate admit it.
    """

    def __init__(self, admin_key: str | None, verified_peers: bool) -> None:
        if admin_key is not None and not admin_key:
            raise ValueError("admin key must not be empty")
        self._key = None if admin_key is None else admin_key.encode()
        self.verified_peers = verified_peers

    @property
    def is_open(self) -> bool:
        """Whether anyone who reaches the server may call (no mTLS, no admin key)."""
        return self._key is None and not self.verified_peers

    async def authorize(self, context: grpc.aio.ServicerContext, what: str) -> None:
        """Return if the caller may do ``what``; otherwise abort the call with
        UNAUTHENTICATED (no credentials) or PERMISSION_DENIED (a wrong admin key)."""
        if self.is_open:
            return
        if self.verified_peers and context.auth_context().get("x509_pem_cert"):
            return
        sent = [value for key, value in context.invocation_metadata() or () if key == AUTHORIZATION]
        if self._key is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{what} needs an mTLS client certificate")
        if not sent or not isinstance(sent[0], str) or not sent[0].startswith(_BEARER):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{what} needs the admin key (authorization: Bearer KEY) or an mTLS client certificate",
            )
        assert self._key is not None
        if not hmac.compare_digest(sent[0][len(_BEARER) :].encode(), self._key):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{what}: wrong admin key")
