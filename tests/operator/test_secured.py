"""A secured PDServeDeployment (charts/pdserve/examples/secured.yaml): its children mount the
Secrets and take the etcd user from them, its command lines make pdserve configs with every TLS
setting on, and no Secret's value reaches the ConfigMap or a command line."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from pdserve.operator import args as cmd
from pdserve.operator.children import CONFIG_HASH, Owner, desired_children
from pdserve.operator.spec import SpecError, parse_spec
from pdserve.rpc.tls import DEFAULT_CLUSTER_SERVER_NAME

SECURED = Path(__file__).parents[2] / "charts" / "pdserve" / "examples" / "secured.yaml"
OWNER = Owner("secured", "serving", "0b9c2f4e-1111-2222-3333-444455556666")
ETCD = "https://secured-etcd.default.svc:2379"


def secured() -> dict:
    body = yaml.safe_load(SECURED.read_text())
    body["spec"]["planner"] = {"enabled": True}  # the default model's planner: its pod too
    return body


def pods(body: dict) -> tuple[dict[str, dict], dict[str, str]]:
    """Each component's pod template, and the ConfigMap's files."""
    desired = desired_children(parse_spec(body), OWNER, ETCD, False, "planner-role")
    templates = {
        o["metadata"]["labels"]["app.kubernetes.io/component"]: o["spec"]["template"]
        for o in desired
        if o["kind"] == "Deployment"
    }
    (config,) = [o for o in desired if o["kind"] == "ConfigMap"]
    return templates, config["data"]


def test_the_pods_mount_the_secrets_and_take_the_etcd_user_from_one() -> None:
    templates, data = pods(secured())
    assert set(templates) == {"prefill", "decode", "frontend", "planner"}
    for component, template in templates.items():
        pod = template["spec"]
        (container,) = pod["containers"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        # etcd's CA and client certificate in every pod; the cluster's certificate where gRPC needs it.
        wanted = {"etcd-tls": ("secured-etcd-tls", cmd.ETCD_TLS_DIR)}
        if component != "planner":  # the planner calls no worker
            wanted["cluster-tls"] = ("secured-cluster-tls", cmd.CLUSTER_TLS_DIR)
        else:
            assert "cluster-tls" not in volumes
        for name, (secret, path) in wanted.items():
            assert volumes[name]["secret"] == {"secretName": secret, "defaultMode": 0o440}, component
            assert mounts[name] == {"name": name, "mountPath": path, "readOnly": True}, component
        env = {e["name"]: e for e in container["env"]}
        for var, key in (("PDSERVE_ETCD_USER", "username"), ("PDSERVE_ETCD_PASSWORD", "password")):
            assert env[var] == {"name": var, "valueFrom": {"secretKeyRef": {"name": "secured-etcd-auth", "key": key}}}
    # The frontend's own Secrets stay the frontend's.
    frontend = {v["name"] for v in templates["frontend"]["spec"]["volumes"]}
    assert {"tls", "api-key"} <= frontend
    assert not {"tls", "api-key"} & {v["name"] for v in templates["decode"]["spec"]["volumes"]}
    # Files are named by path, the etcd user by env: no Secret is read into the ConfigMap.
    text = "\n".join(data.values())
    assert "--etcd-password" not in text and "--etcd-user" not in text and "--admin-key" not in text
    assert "secured-etcd-auth" not in text and "BEGIN" not in text


def test_the_prestop_drain_presents_the_cluster_certificate(mounted: Path) -> None:
    # A worker serving the cluster's mTLS admits a Drain by a cluster certificate alone (no admin key).
    from pdserve.cli import build_parser
    from pdserve.cli.common import cluster_tls

    templates, _ = pods(secured())
    for role in ("prefill", "decode"):
        command = templates[role]["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
        assert command[:4] == ["pdserve", "drain", "--endpoint", f"127.0.0.1:{cmd.WORKER_PORT}"]
        tls = cluster_tls(build_parser().parse_args(_rooted(command[1:], mounted)))
        assert tls is not None and tls.cert == f"{mounted}{cmd.CLUSTER_TLS_DIR}/tls.crt"
        assert tls.server_name == DEFAULT_CLUSTER_SERVER_NAME


@pytest.fixture
def mounted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The files the pods' Secret volumes hold, under ``tmp_path`` instead of /etc/pdserve; the
    etcd user and password in the env, as the kubelet sets them from the Secret."""
    from tests.utils.certs import CertificateAuthority

    cluster = CertificateAuthority(tmp_path, "cluster").cluster_tls("pdserve")
    public = CertificateAuthority(tmp_path, "public").server_tls("frontend")
    etcd_ca = CertificateAuthority(tmp_path, "etcd")
    client = etcd_ca.issue("pdserve")
    for directory, files in (
        (cmd.CLUSTER_TLS_DIR, {"ca.crt": cluster.ca, "tls.crt": cluster.cert, "tls.key": cluster.key}),
        (cmd.ETCD_TLS_DIR, {"ca.crt": etcd_ca.ca, "tls.crt": client.cert, "tls.key": client.key}),
        (cmd.TLS_DIR, {"tls.crt": public.cert, "tls.key": public.key}),
    ):
        target = tmp_path / directory.lstrip("/")
        target.mkdir(parents=True)
        for name, source in files.items():
            (target / name).write_bytes(Path(source).read_bytes())
    (tmp_path / cmd.API_KEY_DIR.lstrip("/")).mkdir(parents=True)
    (tmp_path / cmd.API_KEY_DIR.lstrip("/") / "api-key").write_text("client-key\n")
    monkeypatch.setenv("PDSERVE_ETCD_USER", "pdserve")
    monkeypatch.setenv("PDSERVE_ETCD_PASSWORD", "etcd-pw")
    return tmp_path


def _rooted(argv: list[str], root: Path) -> list[str]:
    return [str(root) + arg if arg.startswith("/etc/pdserve/") else arg for arg in argv]


def test_the_command_lines_make_configs_with_every_tls_setting_on(mounted: Path) -> None:
    # pdserve's own parsers read the arguments files as the pods' `pdserve @FILE` will.
    from pdserve.cli import build_parser
    from pdserve.cli.common import etcd_auth
    from pdserve.cli.frontend_args import frontend_config
    from pdserve.cli.serve import worker_config

    _, data = pods(secured())
    parser = build_parser()

    def parsed(component: str):
        argv = _rooted(data[f"{component}.args"].splitlines(), mounted)
        if component in ("prefill", "decode"):
            argv += cmd.pod_worker_args()
        return parser.parse_args(argv)

    root = str(mounted)
    for role in ("prefill", "decode"):
        config = worker_config(parsed(role))
        assert config.cluster_tls is not None
        assert config.cluster_tls.ca == f"{root}{cmd.CLUSTER_TLS_DIR}/ca.crt"
        assert config.cluster_tls.server_name == DEFAULT_CLUSTER_SERVER_NAME
        assert config.etcd == ETCD
        assert config.etcd_auth.tls is not None and config.etcd_auth.tls.cert == f"{root}{cmd.ETCD_TLS_DIR}/tls.crt"
        assert (config.etcd_auth.user, config.etcd_auth.password) == ("pdserve", "etcd-pw")
    frontend = frontend_config(parsed("frontend"), ETCD)
    assert frontend.cluster_tls is not None and frontend.cluster_tls.key == f"{root}{cmd.CLUSTER_TLS_DIR}/tls.key"
    assert frontend.tls is not None and frontend.tls.cert == f"{root}{cmd.TLS_DIR}/tls.crt"
    assert frontend.api_keys == ["client-key"]
    assert frontend.etcd_auth.tls is not None and frontend.etcd_auth.tls.ca == f"{root}{cmd.ETCD_TLS_DIR}/ca.crt"
    assert (frontend.etcd_auth.user, frontend.etcd_auth.password) == ("pdserve", "etcd-pw")
    planner = etcd_auth(parsed("planner"))
    assert planner.tls is not None and planner.tls.key == f"{root}{cmd.ETCD_TLS_DIR}/tls.key"
    assert (planner.user, planner.password) == ("pdserve", "etcd-pw")


def test_a_changed_secret_rolls_the_pods_that_use_it() -> None:
    before, _ = pods(secured())
    body = secured()
    body["spec"]["clusterTLS"]["secretName"] = "secured-cluster-tls-2"
    after, _ = pods(body)
    for component in ("prefill", "decode", "frontend"):
        assert (
            after[component]["metadata"]["annotations"][CONFIG_HASH]
            != (before[component]["metadata"]["annotations"][CONFIG_HASH])
        ), component
    assert after["planner"]["metadata"]["annotations"] == before["planner"]["metadata"]["annotations"]
    body = secured()
    body["spec"]["etcd"]["auth"]["secretName"] = "other-etcd-user"
    after, _ = pods(body)
    for component in before:
        assert after[component]["metadata"]["annotations"] != before[component]["metadata"]["annotations"], component


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda s: s["clusterTLS"].update(secretName=""), "spec.clusterTLS.secretName"),
        (lambda s: s["etcd"]["auth"].update(secretName=""), "spec.etcd.auth.secretName"),
        (lambda s: s["etcd"].update(endpoints=["http://etcd:2379"]), "spec.etcd.tls"),
        (lambda s: s["etcd"].update(endpoints=[]), "spec.etcd.tls"),
        (lambda s: s["etcd"].update(tls=None, serverName="etcd", endpoints=["etcd:2379"]), "spec.etcd.serverName"),
        (lambda s: s["clusterTLS"].pop("secretName"), "spec.clusterTLS"),
        (lambda s: s.update(clusterTls={"secretName": "x"}), "clusterTls"),
    ],
)
def test_an_undeployable_secured_spec_names_its_field(change, field: str) -> None:
    body = secured()
    change(body["spec"])
    with pytest.raises(SpecError, match=field.replace(".", r"\.")):
        parse_spec(body)


def test_https_etcd_without_a_ca_trusts_the_system_roots() -> None:
    body = secured()
    del body["spec"]["etcd"]["tls"]
    spec = parse_spec(copy.deepcopy(body))
    argv = cmd.worker_args(spec, "decode", ETCD)
    assert "--etcd-cacert" not in argv and "--etcd-cert" not in argv
    templates, _ = pods(body)
    assert "etcd-tls" not in {v["name"] for v in templates["decode"]["spec"]["volumes"]}


def test_every_secured_child_is_a_valid_kubernetes_object() -> None:
    import kubernetes_validate

    for obj in desired_children(parse_spec(secured()), OWNER, ETCD, False, "planner-role"):
        kubernetes_validate.validate(obj, "1.25", strict=True)
