"""How a process proves itself to etcd: TLS (the CA etcd's certificate chains to, and a client
certificate where etcd runs with ``--client-cert-auth``) and etcd's own user and password.

etcd with auth enabled admits a request by the user its token names (``user`` and
``password``, exchanged for a token when the client connects) or, with no token and a client
certificate, by the certificate's common name. ``EtcdAuth.client`` builds the aetcd client for
either. aetcd 1.0 dials plaintext only, so ``_TLSClient`` opens the same stubs over a TLS
channel.
"""

from __future__ import annotations

import asyncio

import aetcd
import grpc
import msgspec
from aetcd import rpc
from aetcd.watcher import Watcher

from pdserve.rpc.tls import ClientTLS

# Each client dials on its own: by default gRPC shares a process's connections to one address
# among its channels, so a new client to an etcd that just came back inherited the old
# channel's failure and its reconnect back-off ("Connection refused" for seconds).
_CHANNEL_OPTIONS = {"grpc.use_local_subchannel_pool": 1}


class EtcdAuth(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Attributes:
    tls: the TLS settings for an ``https://`` etcd URL (``--etcd-cacert``, ``--etcd-cert``,
        ``--etcd-key``); None: the system's roots, no client certificate.
    user / password: an etcd user (``--etcd-user``, ``--etcd-password`` or
        ``$PDSERVE_ETCD_USER``, ``$PDSERVE_ETCD_PASSWORD``); both or neither.
    """

    tls: ClientTLS | None = None
    user: str | None = None
    password: str | None = None

    def __post_init__(self) -> None:
        if (self.user is None) != (self.password is None):
            raise ValueError("etcd auth needs both a user and a password (--etcd-user, --etcd-password)")

    def __repr__(self) -> str:  # never the password
        return f"EtcdAuth(tls={self.tls!r}, user={self.user!r}, password={'***' if self.password else None})"

    def client(self, host: str, port: int, *, use_tls: bool, timeout_s: float) -> aetcd.Client:
        """An aetcd client (not yet connected) to ``host:port``, over TLS when ``use_tls``."""
        if not use_tls:
            return aetcd.Client(
                host, port, username=self.user, password=self.password, timeout=timeout_s, options=_CHANNEL_OPTIONS
            )
        tls = self.tls or ClientTLS()
        return _TLSClient(
            host,
            port,
            username=self.user,
            password=self.password,
            timeout=timeout_s,
            credentials=tls.grpc_credentials(),
            options=_CHANNEL_OPTIONS | dict(tls.grpc_options()),
        )


class _TLSClient(aetcd.Client):
    """aetcd's client over a TLS channel: the same stubs, token and watcher ``connect`` sets up."""

    def __init__(self, *args: object, credentials: grpc.ChannelCredentials, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._credentials = credentials
        self._dialing = asyncio.Lock()

    async def connect(self) -> None:
        async with self._dialing:
            if self._connected.is_set():
                return
            self.channel = grpc.aio.secure_channel(
                f"{self._host}:{self._port}", self._credentials, options=list(self._options.items())
            )
            if self._username is not None:
                try:
                    reply = await rpc.AuthStub(self.channel).Authenticate(
                        rpc.AuthenticateRequest(name=self._username, password=self._password), timeout=self._timeout
                    )
                except grpc.aio.AioRpcError as error:
                    await self.channel.close()
                    self._init_channel_attrs()
                    raise aetcd.exceptions.ClientError(f"{error.code().name}: {error.details()}") from error
                self.metadata = (("token", reply.token),)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = Watcher(rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata)
            self._connected.set()
