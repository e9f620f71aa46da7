"""The etcd client over TLS with client certificates and etcd's own auth, against a real etcd
(``secure_etcd``: --client-cert-auth, auth enabled with pdserve's roles)."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from pdserve.discovery.etcd import ETCD_ERRORS, EtcdConnection, RegistryUnavailable, close_quietly, connect
from pdserve.discovery.etcd_auth import EtcdAuth
from pdserve.discovery.registration import WorkerRegistration
from pdserve.discovery.registry import list_workers
from pdserve.discovery.slo import SLOTargets
from pdserve.discovery.slo_store import get_slo, put_slo
from pdserve.rpc.tls import ClientTLS
from tests.cli.test_operate import make_entry
from tests.conftest import OPERATOR_PASSWORD
from tests.utils.aio import run_scenario
from tests.utils.certs import CertificateAuthority
from tests.utils.etcd_roles import enable_auth
from tests.utils.etcd_server import EtcdServer, EtcdTLS


def _refusal(url: str, auth: EtcdAuth) -> str:
    async def main() -> str:
        with pytest.raises(RegistryUnavailable) as error:
            await connect(url, 3.0, auth)
        return str(error.value)

    return run_scenario(main(), 30)


def test_the_operator_user_writes_slos_and_may_not_touch_worker_keys(secure_etcd):
    model = f"auth-{uuid.uuid4().hex[:8]}"
    slo = SLOTargets(model=model, ttft_p90_s=0.5, itl_p90_s=0.03)

    async def main():
        client = await connect(secure_etcd.url, 3.0, secure_etcd.auth(user="operator", password=OPERATOR_PASSWORD))
        try:
            await put_slo(client, slo)
            assert await get_slo(client, model) == slo
            with pytest.raises(ETCD_ERRORS, match="permission denied"):
                await client.put(f"/pdserve/v1/workers/{model}/decode/forged".encode(), b"x")
        finally:
            await close_quietly(client)

    run_scenario(main(), 30)


def test_a_worker_known_by_its_certificate_registers_and_may_not_write_slos(secure_etcd):
    # No user or password: with --client-cert-auth, etcd takes the certificate's common name as the user.
    model = f"auth-{uuid.uuid4().hex[:8]}"
    entry = make_entry(model, "decode-cert", "decode")

    async def main():
        etcd = EtcdConnection(secure_etcd.url, auth=secure_etcd.auth("pdserve-worker"))
        registration = WorkerRegistration(etcd, entry, lambda: entry.load, draining=lambda: False, ttl_s=5)
        try:
            await registration.start()
            async with etcd.use() as client:
                assert [w.worker_id for w in await list_workers(client) if w.model == model] == ["decode-cert"]
                with pytest.raises(ETCD_ERRORS, match="permission denied"):
                    await put_slo(client, SLOTargets(model=model, ttft_p90_s=1, itl_p90_s=1))
        finally:
            await registration.close()
            await etcd.close()

    run_scenario(main(), 30)


def test_credentials_etcd_refuses_are_named(secure_etcd, tmp_path):
    url = secure_etcd.url
    wrong = _refusal(url, secure_etcd.auth(user="operator", password="guess"))
    assert wrong.startswith(f"etcd at {url} refused the request") and "authentication failed" in wrong
    assert "--etcd-user" in wrong
    # A certificate whose common name is no etcd user, and no user given.
    assert "refused the request" in _refusal(url, secure_etcd.auth("nobody"))


def test_without_a_client_certificate_or_with_another_cas_the_connection_fails(secure_etcd, tmp_path):
    url = secure_etcd.url
    other = CertificateAuthority(tmp_path, "other").client_tls("pdserve-worker", ca=secure_etcd.ca.ca)
    for auth in (EtcdAuth(tls=ClientTLS(ca=secure_etcd.ca.ca)), EtcdAuth(tls=other)):
        message = _refusal(url, auth)
        assert message.startswith(f"etcd at {url}: TLS failed") and "--etcd-cert" in message, message
    # And a client that does not trust etcd's CA (the system's roots) refuses etcd.
    message = _refusal(url, EtcdAuth())
    assert message.startswith(f"etcd at {url}: TLS failed") and "CERTIFICATE_VERIFY_FAILED" in message


def test_tls_options_need_an_https_url():
    with pytest.raises(ValueError, match="need an https:// URL"):
        EtcdConnection("http://127.0.0.1:2379", auth=EtcdAuth(tls=ClientTLS()))
    with pytest.raises(ValueError, match="both a user and a password"):
        EtcdAuth(user="operator")
    assert "pw" not in repr(EtcdAuth(user="u", password="pw"))


def test_a_plain_etcd_is_reached_over_http_as_before(etcd_url):
    async def main():
        client = await connect(etcd_url, 3.0)
        await close_quietly(client)

    asyncio.run(main())


@pytest.mark.slow
def test_a_connection_idle_past_its_token_signs_in_again(tmp_path):
    # etcd forgets a user's token once unused for --auth-token-ttl; the call that finds it gone
    # fails, and the connection's next use dials and signs in afresh.
    ca = CertificateAuthority(tmp_path, "etcd")
    cert, probe = ca.issue("etcd", ips=("127.0.0.1",)), ca.issue("root")
    server = EtcdServer(
        tmp_path,
        EtcdTLS(cert=cert.cert, key=cert.key, ca=ca.ca, probe_cert=probe.cert, probe_key=probe.key),
        extra_args=("--auth-token-ttl=1",),
    ).start()
    try:
        run_scenario(
            enable_auth(
                server.url.removeprefix("https://"),
                ClientTLS(ca=ca.ca, cert=probe.cert, key=probe.key),
                "root-pw",
                {"operator": ("pw", "pdserve-operator")},
            ),
            30,
        )

        async def main() -> list[str]:
            etcd = EtcdConnection(server.url, auth=EtcdAuth(tls=ca.client_tls("x"), user="operator", password="pw"))
            outcomes = []
            try:
                for pause_s in (0.2, 3.0, 0.0):
                    try:
                        async with etcd.use() as client:
                            await client.get(b"/pdserve/v1/slo/m")
                        outcomes.append("ok")
                    except ETCD_ERRORS as error:
                        outcomes.append(str(error))
                    await asyncio.sleep(pause_s)
                async with etcd.use() as client:
                    await client.get(b"/pdserve/v1/slo/m")
                return outcomes
            finally:
                await etcd.close()

        outcomes = run_scenario(main(), 60)
        assert outcomes[:2] == ["ok", "ok"] and outcomes[2] == "etcdserver: invalid auth token"
    finally:
        server.close()
