"""Who may call a worker's RPCs: the component a verified peer's certificate names, or, for
an administrative RPC (``Drain``), a caller with the admin key.

A server that requires client certificates from the cluster CA (``ClusterTLS``) has already
verified every peer in the TLS handshake; its ``auth_context`` then names the peer's
certificate. Its common name says which component it is (README: Security):

- ``pdserve-frontend`` (``FRONTEND``) may call the serving RPCs: ``Prefill``, ``Release``,
  ``Decode``, ``KVReady``;
- ``pdserve-worker`` (``WORKER``) may call ``KVReady`` (a prefill worker tells a decode worker
  its KV is ready) and ``Drain`` (a worker pod's preStop drains its own worker with the pod's
  certificate);
- ``pdserve-tools`` (``TOOLS``: ``pdserve up`` and the ``pdserve`` commands run beside it) and
  ``pdserve-operator`` (``OPERATOR``) may call ``Drain``;
- ``pdserve-registry`` (``REGISTRY``: the embedded etcd's own certificate) may call nothing.

A certificate whose common name is none of these (one certificate shared by every component,
as a cluster set made by hand may be) may call every RPC: the CA vouches for it, and it names
no role to hold it to. Without cluster TLS, ``Drain`` needs ``authorization: Bearer KEY``
metadata with the server's admin key, compared in constant time, and the serving RPCs are open.
A server with neither is an unsecured deployment, and every RPC is open (the process says so
at start).
"""

from __future__ import annotations

import hmac

import grpc

AUTHORIZATION = "authorization"
_BEARER = "Bearer "
FRONTEND = "pdserve-frontend"
WORKER = "pdserve-worker"
TOOLS = "pdserve-tools"
OPERATOR = "pdserve-operator"
REGISTRY = "pdserve-registry"
# What each component may call; a component's certificate admits it to nothing else.
CALLERS: dict[str, frozenset[str]] = {
    "Prefill": frozenset({FRONTEND}),
    "Release": frozenset({FRONTEND}),
    "Decode": frozenset({FRONTEND}),
    "KVReady": frozenset({FRONTEND, WORKER}),
    "Drain": frozenset({TOOLS, OPERATOR, WORKER}),
}
COMPONENTS = frozenset({FRONTEND, WORKER, TOOLS, OPERATOR, REGISTRY})


def admin_metadata(admin_key: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries ``admin_key`` (none without one)."""
    return () if admin_key is None else ((AUTHORIZATION, f"{_BEARER}{admin_key}"),)


def peer_common_name(context: grpc.aio.ServicerContext) -> str | None:
    """The common name of the client certificate the TLS handshake verified, if any."""
    auth = context.auth_context()
    if not auth.get("x509_pem_cert"):
        return None
    names = auth.get("x509_common_name") or [b""]
    return names[0].decode(errors="replace")


class AdminPolicy:
    """Attributes:
    admin_key: the key an administrative call must carry, or None.
    verified_peers: whether the server verifies client certificates against a CA it trusts
        (mTLS); only then does a peer's certificate admit it, as the component it names.
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

    def _admits(self, context: grpc.aio.ServicerContext, rpc: str) -> tuple[bool, str | None]:
        """Whether the verified peer's certificate admits it to ``rpc``, and its common name."""
        name = peer_common_name(context) if self.verified_peers else None
        if name is None:
            return False, None
        return name not in COMPONENTS or name in CALLERS[rpc], name

    async def check_caller(self, context: grpc.aio.ServicerContext, rpc: str) -> None:
        """Return if the caller may call the serving RPC ``rpc`` (a key of ``CALLERS``);
        otherwise abort the call with PERMISSION_DENIED naming the component allowed. Open
        without mTLS."""
        if not self.verified_peers:
            return
        admitted, name = self._admits(context, rpc)
        if not admitted:
            allowed = " or ".join(sorted(CALLERS[rpc]))
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{rpc} is for {allowed} only: the caller's certificate names {name!r} (its common name)",
            )

    async def authorize(self, context: grpc.aio.ServicerContext, what: str) -> None:
        """Return if the caller may do the administrative ``what`` (``Drain``); otherwise abort
        the call with UNAUTHENTICATED (no credentials) or PERMISSION_DENIED (a wrong admin key,
        or a certificate naming a component that may not)."""
        if self.is_open:
            return
        admitted, name = self._admits(context, what)
        if admitted:
            return
        sent = [value for key, value in context.invocation_metadata() or () if key == AUTHORIZATION]
        if self._key is None:
            if name is not None:
                allowed = " or ".join(sorted(CALLERS[what]))
                await context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"{what} is for {allowed} only: the caller's certificate names {name!r} (its common name)",
                )
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{what} needs an mTLS client certificate")
        if not sent or not isinstance(sent[0], str) or not sent[0].startswith(_BEARER):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{what} needs the admin key (authorization: Bearer KEY) or an mTLS client certificate",
            )
        assert self._key is not None
        if not hmac.compare_digest(sent[0][len(_BEARER) :].encode(), self._key):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{what}: wrong admin key")
