"""Certificate authorities and certificates that tests make for themselves (``cryptography``)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pdserve.rpc.tls import DEFAULT_CLUSTER_SERVER_NAME, ClientTLS, ClusterTLS, ServerTLS


@dataclass(frozen=True)
class Issued:
    """A certificate and its key, as PEM files."""

    cert: str
    key: str


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


class CertificateAuthority:
    """A self-signed CA in ``directory`` (``NAME-ca.pem``) that issues certificates beside it."""

    def __init__(self, directory: Path, name: str) -> None:
        self.directory = directory
        self.name = name
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(_name(f"{name} CA"))
            .issuer_name(_name(f"{name} CA"))
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )
        self.ca = str(directory / f"{name}-ca.pem")
        Path(self.ca).write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, common_name: str, dns: tuple[str, ...] = (), ips: tuple[str, ...] = ()) -> Issued:
        """A certificate for ``common_name``, good as a server's (for ``dns`` and ``ips``) and a client's."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        sans = [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        stem = self.directory / f"{self.name}-{common_name}"
        Path(f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, Path(f"{stem}-key.pem"))
        return Issued(cert=f"{stem}.pem", key=f"{stem}-key.pem")

    def server_tls(self, common_name: str = "server", client_ca: str | None = None) -> ServerTLS:
        """A loopback server's TLS (SANs localhost and 127.0.0.1)."""
        issued = self.issue(common_name, dns=("localhost",), ips=("127.0.0.1",))
        return ServerTLS(cert=issued.cert, key=issued.key, client_ca=client_ca)

    def client_tls(self, common_name: str = "client", ca: str | None = None) -> ClientTLS:
        """A client certificate from this CA, trusting ``ca`` (default: this CA)."""
        issued = self.issue(common_name)
        return ClientTLS(ca=ca or self.ca, cert=issued.cert, key=issued.key)

    def cluster_tls(self, common_name: str) -> ClusterTLS:
        """A cluster member's certificate set: it names only the cluster's server name."""
        issued = self.issue(common_name, dns=(DEFAULT_CLUSTER_SERVER_NAME,))
        return ClusterTLS(ca=self.ca, cert=issued.cert, key=issued.key)
