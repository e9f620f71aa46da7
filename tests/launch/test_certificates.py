"""The certificates ``pdserve up`` makes for its deployment: they chain to its CA, name the
cluster server name and loopback, serve and present, and only their owner reads the keys."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
import stat

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pdserve.launch.certificates import COMPONENTS, issue_deployment_certificates


def _load(path: str) -> x509.Certificate:
    with open(path, "rb") as file:
        return x509.load_pem_x509_certificate(file.read())


def test_each_component_gets_its_own_certificate_from_one_ca(tmp_path):
    issued = issue_deployment_certificates(tmp_path / "tls")
    assert sorted(issued) == sorted(COMPONENTS)
    ca = _load(issued["pdserve-frontend"].ca)
    for name, tls in issued.items():
        cert = _load(tls.cert)
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == name
        cert.verify_directly_issued_by(ca)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert sans.get_values_for_type(x509.DNSName) == ["pdserve-cluster"]
        assert set(sans.get_values_for_type(x509.IPAddress)) == {
            ipaddress.ip_address("127.0.0.1"),
            ipaddress.ip_address("::1"),
        }
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
        assert cert.not_valid_after_utc - cert.not_valid_before_utc <= datetime.timedelta(days=31)
        tls.check()  # a matching certificate and key
    assert len({_load(t.cert).serial_number for t in issued.values()}) == len(COMPONENTS)


def test_keys_are_the_owners_alone_and_the_ca_key_is_never_written(tmp_path):
    directory = tmp_path / "tls"
    issued = issue_deployment_certificates(directory, server_name="other-name")
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for tls in issued.values():
        assert stat.S_IMODE((directory / tls.key).stat().st_mode) == 0o600
        assert tls.server_name == "other-name"
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        ["ca.pem", *(f"{n}.pem" for n in COMPONENTS), *(f"{n}-key.pem" for n in COMPONENTS)]
    )
    with pytest.raises(FileExistsError):
        issue_deployment_certificates(directory)


def test_a_tls_handshake_verifies_the_chain_and_the_cluster_name(tmp_path):
    issued = issue_deployment_certificates(tmp_path / "tls")
    worker, tools = issued["pdserve-worker"], issued["pdserve-tools"]
    client_context = ssl.create_default_context(cafile=tools.ca)
    client_context.load_cert_chain(tools.cert, tools.key)
    seen = {}

    async def main():
        async def handle(reader, writer):
            seen["peer"] = writer.get_extra_info("peercert")
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=worker.server.ssl_context())
        port = server.sockets[0].getsockname()[1]
        try:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, ssl=client_context, server_hostname="pdserve-cluster"
            )
            await reader.read()
            writer.close()
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(main())
    assert dict(x[0] for x in seen["peer"]["subject"])["commonName"] == "pdserve-tools"
    # Another deployment's certificate does not chain to this one's CA.
    other = issue_deployment_certificates(tmp_path / "other")["pdserve-tools"]
    with pytest.raises((ValueError, InvalidSignature)):
        _load(other.cert).verify_directly_issued_by(_load(tools.ca))
