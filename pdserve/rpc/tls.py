"""TLS settings for pdserve's servers and clients, as configuration structs.

Three shapes, each a plain msgspec Struct of PEM file paths that travels inside a component's
configuration (and so in the JSON ``pdserve up`` writes for its children):

- ``ServerTLS``: a server's certificate chain and key; with ``client_ca`` it requires client
  certificates signed by that CA (mTLS). The public Inference API (``--tls-cert``,
  ``--tls-key``, ``--tls-client-ca``) uses it for gRPC (``grpc_credentials``) and any other
  server for its ``ssl.SSLContext`` (``ssl_context``).
- ``ClientTLS``: what a client trusts (``ca``; None: the system's roots), the certificate it
  presents (mTLS), and the name it checks the server's certificate for.
- ``ClusterTLS``: the cluster's one certificate set (CA, certificate, key). Every internal
  server requires a client certificate from the CA; every internal client presents its own.

Server names inside the cluster: workers advertise ``host:port`` endpoints (loopback, pod IPs)
that no certificate can list ahead of time. So an internal client checks that the server's
certificate chains to the cluster CA *and* names ``ClusterTLS.server_name``
(``pdserve-cluster`` unless set) in its subject alternative names, whatever address it dialled:
every cluster certificate carries that DNS name, besides any others.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from pathlib import Path

import grpc
import msgspec

DEFAULT_CLUSTER_SERVER_NAME = "pdserve-cluster"


def read_pem(path: str, what: str) -> bytes:
    """The file's bytes; ValueError naming ``what`` (an option or field) and the file."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"{what} {path}: {error.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what} {path}: not a PEM file")
    return data


def _check_pair(cert: str, key: str, what: str) -> None:
    """ValueError unless ``cert`` and ``key`` are a PEM certificate and its private key."""
    read_pem(cert, f"{what} certificate")
    read_pem(key, f"{what} key")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as error:
        raise ValueError(f"{what}: {cert} and {key} are not a certificate and its key: {error.reason}") from None


def _check_ca(ca: str, what: str) -> None:
    read_pem(ca, what)
    try:
        ssl.create_default_context(cafile=ca)
    except ssl.SSLError as error:
        raise ValueError(f"{what} {ca}: not a CA certificate: {error.reason}") from None


class ServerTLS(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Attributes:
    cert: the server's certificate chain (PEM).
    key: its private key (PEM).
    client_ca: the CA (PEM) whose client certificates the server requires (mTLS); None: any
        client may connect (server-side TLS only).
    """

    cert: str
    key: str
    client_ca: str | None = None

    def check(self) -> None:
        """ValueError naming the file that is missing, not PEM, or not a matching pair."""
        _check_pair(self.cert, self.key, "TLS server")
        if self.client_ca is not None:
            _check_ca(self.client_ca, "TLS client CA")

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """Credentials for ``server.add_secure_port``."""
        self.check()
        return grpc.ssl_server_credentials(
            [(read_pem(self.key, "TLS key"), read_pem(self.cert, "TLS certificate"))],
            root_certificates=None if self.client_ca is None else read_pem(self.client_ca, "TLS client CA"),
            require_client_auth=self.client_ca is not None,
        )

    def ssl_context(self) -> ssl.SSLContext:
        """A server-side ``ssl.SSLContext`` (TLS 1.2 or later), requiring client certificates
        from ``client_ca`` when it is set: for an HTTP server or any asyncio server."""
        self.check()
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert, self.key)
        if self.client_ca is not None:
            context.load_verify_locations(cafile=self.client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context


class ClientTLS(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Attributes:
    ca: the CA (PEM) the server's certificate must chain to; None: the system's roots.
    cert / key: the client certificate (PEM) and key presented to a server that requires one.
    server_name: the name the server's certificate must carry; None: the host dialled.
    """

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate needs its key and a key its certificate: give both or neither")

    def check(self) -> None:
        """ValueError naming the file that is missing, not PEM, or not a matching pair."""
        if self.ca is not None:
            _check_ca(self.ca, "TLS CA")
        if self.cert is not None and self.key is not None:
            _check_pair(self.cert, self.key, "TLS client")

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        self.check()
        return grpc.ssl_channel_credentials(
            root_certificates=None if self.ca is None else read_pem(self.ca, "TLS CA"),
            private_key=None if self.key is None else read_pem(self.key, "TLS key"),
            certificate_chain=None if self.cert is None else read_pem(self.cert, "TLS certificate"),
        )

    def grpc_options(self) -> list[tuple[str, str]]:
        """Channel options: the server name to check, when it is not the host dialled."""
        return [] if self.server_name is None else [("grpc.ssl_target_name_override", self.server_name)]


class ClusterTLS(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The cluster's certificate set for internal mTLS (``--cluster-ca/--cluster-cert/--cluster-key``).

    Attributes:
    ca: the cluster CA (PEM): internal servers accept only client certificates it signed, and
        internal clients only server certificates it signed.
    cert / key: this component's certificate (PEM; it serves and presents it) and its key.
    server_name: the DNS name every cluster certificate carries in its subject alternative
        names; clients check it instead of the address they dialled.
    """

    ca: str
    cert: str
    key: str
    server_name: str = DEFAULT_CLUSTER_SERVER_NAME

    def __post_init__(self) -> None:
        if not self.server_name:
            raise ValueError("cluster TLS server_name must not be empty")

    @property
    def server(self) -> ServerTLS:
        """An internal server's TLS: this certificate, client certificates from the CA required."""
        return ServerTLS(cert=self.cert, key=self.key, client_ca=self.ca)

    @property
    def client(self) -> ClientTLS:
        """An internal client's TLS: trust the CA only, present this certificate, check ``server_name``."""
        return ClientTLS(ca=self.ca, cert=self.cert, key=self.key, server_name=self.server_name)

    def check(self) -> None:
        self.server.check()


def secure_or_insecure_channel(
    target: str, tls: ClientTLS | None, options: Sequence[tuple[str, int | str]] | None = None
) -> grpc.aio.Channel:
    """A grpc.aio channel to ``target``: TLS with ``tls``, plaintext without."""
    options = list(options or [])
    if tls is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, tls.grpc_credentials(), options=options + tls.grpc_options())
