"""The desired children, computed from the spec alone: names, ownership, what rolls a pool."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from pdserve.operator import args as cmd
from pdserve.operator.children import CONFIG_HASH, Owner, desired_children
from pdserve.operator.spec import SpecError, parse_spec

EXAMPLES = Path(__file__).parents[2] / "charts" / "pdserve" / "examples"
OWNER = Owner("llama", "serving", "0b9c2f4e-1111-2222-3333-444455556666")
ETCD = "http://etcd:2379"
PLANNER_ROLE = "rel-pdserve-planner"


def example(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / name).read_text())


def children(body: dict, lws: bool = False) -> dict[tuple[str, str], dict]:
    desired = desired_children(parse_spec(body), OWNER, ETCD, lws, PLANNER_ROLE)
    return {(o["kind"], o["metadata"]["name"]): o for o in desired}


def template_hash(objects: dict, name: str) -> str:
    return objects[("Deployment", name)]["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH]


def test_the_children_are_named_owned_and_deterministic() -> None:
    body = example("llama-small.yaml")
    first, second = children(body), children(copy.deepcopy(body))
    assert first == second
    assert set(first) == {
        ("ConfigMap", "llama-config"),
        ("Deployment", "llama-frontend"),
        ("Service", "llama"),
        ("Deployment", "llama-prefill"),
        ("Service", "llama-prefill"),
        ("Deployment", "llama-decode"),
        ("Service", "llama-decode"),
    }
    for obj in first.values():
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
            "PDServeDeployment",
            "llama",
            OWNER.uid,
            True,
        )
        assert obj["metadata"]["namespace"] == "serving"
    assert first[("Deployment", "llama-decode")]["spec"]["replicas"] == 2


def test_engine_args_roll_only_their_pool_and_replicas_roll_nothing() -> None:
    body = example("llama-small.yaml")
    before = children(body)
    changed = copy.deepcopy(body)
    changed["spec"]["decode"]["engineArgs"]["maxNumSeqs"] = 64
    after = children(changed)
    assert template_hash(after, "llama-decode") != template_hash(before, "llama-decode")
    assert template_hash(after, "llama-prefill") == template_hash(before, "llama-prefill")
    assert "--max-num-seqs\n64\n" in after[("ConfigMap", "llama-config")]["data"]["decode.args"]

    scaled = copy.deepcopy(body)
    scaled["spec"]["decode"]["replicas"] = 5
    after = children(scaled)
    assert after[("Deployment", "llama-decode")]["spec"]["replicas"] == 5
    assert (
        after[("Deployment", "llama-decode")]["spec"]["template"]
        == before[("Deployment", "llama-decode")]["spec"]["template"]
    )


def test_worker_pods_drain_before_they_stop() -> None:
    objects = children(example("deepseek-v3.yaml"))
    pod = objects[("Deployment", "llama-prefill")]["spec"]["template"]["spec"]
    # drain (60 s default) + the prefill hold the example sets (60 s) + the shutdown margin
    assert pod["terminationGracePeriodSeconds"] == 60 + 60 + cmd.SHUTDOWN_MARGIN_S
    pre_stop = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop == ["pdserve", "drain", "--endpoint", f"127.0.0.1:{cmd.WORKER_PORT}", "--wait", "--timeout", "120s"]
    decode = objects[("Deployment", "llama-decode")]["spec"]["template"]["spec"]
    assert decode["terminationGracePeriodSeconds"] == 60 + 60 + cmd.SHUTDOWN_MARGIN_S
    assert decode["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    args = objects[("ConfigMap", "llama-config")]["data"]["decode.args"].splitlines()
    assert args[args.index("--data-parallel-size") + 1] == "8" and "--enable-expert-parallel" in args


def test_worker_and_frontend_pods_probe_readyz_and_livez_on_the_metrics_port() -> None:
    body = example("llama-small.yaml")
    body["spec"]["planner"] = {"enabled": True, "profileConfigMap": "profile"}
    objects = children(body)
    for component in ("prefill", "decode", "frontend"):
        [container] = objects[("Deployment", f"llama-{component}")]["spec"]["template"]["spec"]["containers"]
        assert {"name": "metrics", "containerPort": cmd.METRICS_PORT, "protocol": "TCP"} in container["ports"]
        paths = {kind: container[kind]["httpGet"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
        assert paths == {
            "startupProbe": {"path": "/livez", "port": cmd.METRICS_PORT, "scheme": "HTTP"},
            "livenessProbe": {"path": "/livez", "port": cmd.METRICS_PORT, "scheme": "HTTP"},
            "readinessProbe": {"path": "/readyz", "port": cmd.METRICS_PORT, "scheme": "HTTP"},
        }, component
        startup = container["startupProbe"]
        # Liveness waits for the startup probe: a big model's load must fit in its allowance.
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60
    planner = objects[("Deployment", "llama-planner")]["spec"]["template"]["spec"]["containers"][0]
    assert not {"startupProbe", "livenessProbe", "readinessProbe"} & set(planner)


def test_engine_args_become_options() -> None:
    assert cmd.options({"maxNumSeqs": 64, "noPrefixCaching": True, "enforceEager": False, "dtype": "bfloat16"}) == [
        "--max-num-seqs",
        "64",
        "--no-prefix-caching",
        "--dtype",
        "bfloat16",
    ]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda s: s["decode"].update(engineArgs={"maxNumSeqs": {"nested": 1}}), "spec.decode.engineArgs.maxNumSeqs"),
        (lambda s: s["model"].update(path="models/llama"), "spec.model.path"),
        (lambda s: s["model"]["volume"].update(hostPath={"path": "/cache"}), "spec.model.volume"),
        (lambda s: s["slo"].update(minDecodeReplicas=9), "spec.slo"),
        (lambda s: s["prefill"]["engineArgs"].update(hold="soon"), "spec.prefill.engineArgs.hold"),
        (lambda s: s.update(planner={"enabled": True}), "spec.planner.profileConfigMap"),
    ],
)
def test_an_undeployable_spec_names_its_field(change, field: str) -> None:
    body = example("llama-small.yaml")
    change(body["spec"])
    with pytest.raises((SpecError, ValueError), match=field.replace(".", r"\.")):
        desired_children(parse_spec(body), OWNER, ETCD, False)


@pytest.mark.parametrize("name", ["llama-small.yaml", "deepseek-v3.yaml"])
def test_every_child_is_a_valid_kubernetes_object(name: str) -> None:
    import kubernetes_validate

    body = example(name)
    body["spec"]["tls"] = {"secretName": "tls"}
    body["spec"]["planner"] = {"enabled": True, "profileConfigMap": "profile", "serviceAccountName": "planner"}
    for obj in children(body).values():
        kubernetes_validate.validate(obj, "1.25", strict=True)


def test_every_command_line_the_operator_writes_is_one_pdserve_accepts() -> None:
    # The spec -> argv mapping names real options: parsed by pdserve's own parser, as the pods'
    # `pdserve @FILE` will. (Parallelism options wait for multi-rank workers; the example has none.)
    from pdserve.cli import build_parser

    body = example("llama-small.yaml")
    body["spec"] |= {
        "tls": {"secretName": "llama-tls"},
        "apiKeys": {"secretName": "llama-keys"},
        "planner": {"enabled": True, "profileConfigMap": "llama-profile"},
    }
    spec = parse_spec(body)
    argvs = {
        "prefill": cmd.worker_args(spec, "prefill", ETCD) + cmd.pod_worker_args(),
        "decode": cmd.worker_args(spec, "decode", ETCD) + cmd.pod_worker_args(),
        "frontend": cmd.frontend_args(spec, ETCD),
        "planner": cmd.planner_args(spec, "serving", "llama", ETCD),
    }
    parser = build_parser()
    for component, argv in argvs.items():
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"pdserve refuses the {component} command line the operator writes: {argv}")
    assert "--tls-cert" in argvs["frontend"] and "--api-key-file" in argvs["frontend"]


def test_the_default_model_example_runs_pdserves_default_model_on_two_cpus() -> None:
    # Its workers' command lines, as the pods run them, make the configs a 2-CPU node holds.
    from pdserve.cli import build_parser
    from pdserve.cli.serve import worker_config
    from pdserve.model.default_model import DEFAULT_MODEL_NAME, WHEEL_MEMBER

    spec = parse_spec(example("default-model.yaml"))
    assert (spec.image, spec.image_pull_policy, spec.planner.enabled) == ("pdserve:dev", "Never", False)
    parser = build_parser()
    threads = 0
    for role in ("prefill", "decode"):
        assert getattr(spec, role).replicas == 1
        config = worker_config(parser.parse_args(cmd.worker_args(spec, role, ETCD) + cmd.pod_worker_args()))
        assert config.served_model_name == DEFAULT_MODEL_NAME
        assert Path(config.model).name == Path(WHEEL_MEMBER).name
        assert config.engine.kv_cache_memory == 256 * 2**20 and config.engine.max_num_seqs <= 8
        threads += config.num_threads
    assert threads <= 2
    pod = children(example("default-model.yaml"))[("Deployment", "llama-decode")]["spec"]["template"]["spec"]
    assert pod["containers"][0]["imagePullPolicy"] == "Never"
    (model,) = [v for v in pod["volumes"] if v["name"] == "model"]
    assert model["hostPath"]["path"] == "/var/lib/pdserve/models"
    # The frontend tokenizes with the model the workers registered: it needs the files too.
    frontend = children(example("default-model.yaml"))[("Deployment", "llama-frontend")]["spec"]["template"]["spec"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in frontend["containers"][0]["volumeMounts"]


def test_a_planner_without_a_service_account_gets_its_own_bound_to_the_planner_role() -> None:
    body = example("llama-small.yaml")
    body["spec"]["planner"] = {"enabled": True, "profileConfigMap": "profile"}
    objects = children(body)
    account, binding = objects[("ServiceAccount", "llama-planner")], objects[("RoleBinding", "llama-planner")]
    for obj in (account, binding):
        assert obj["metadata"]["namespace"] == "serving"
        assert obj["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": PLANNER_ROLE}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llama-planner", "namespace": "serving"}]
    assert objects[("Deployment", "llama-planner")]["spec"]["template"]["spec"]["serviceAccountName"] == "llama-planner"
    # Its metrics (SLO targets, decisions) are served where its pod declares them, and scraped.
    planner = objects[("Deployment", "llama-planner")]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "metrics", "containerPort": cmd.METRICS_PORT, "protocol": "TCP"} in planner["ports"]
    assert objects[("Service", "llama-planner")]["spec"]["clusterIP"] == "None"
    assert f"--metrics-port\n{cmd.METRICS_PORT}\n" in objects[("ConfigMap", "llama-config")]["data"]["planner.args"]
    # The spec's own service account: nothing to make, and the pod runs under it.
    body["spec"]["planner"]["serviceAccountName"] = "mine"
    objects = children(body)
    assert not {("ServiceAccount", "llama-planner"), ("RoleBinding", "llama-planner")} & set(objects)
    assert objects[("Deployment", "llama-planner")]["spec"]["template"]["spec"]["serviceAccountName"] == "mine"
    # An operator that has no planner role to bind says which field the spec then needs.
    del body["spec"]["planner"]["serviceAccountName"]
    with pytest.raises(ValueError, match=r"spec\.planner\.serviceAccountName"):
        desired_children(parse_spec(body), OWNER, ETCD, False)


def test_the_default_models_planner_runs_on_the_profile_pdserve_ships() -> None:
    from pdserve.cli import build_parser
    from pdserve.cli.planner import load_planner
    from pdserve.planner.profile import EngineProfile, builtin_profile

    body = example("default-model.yaml")
    body["spec"]["planner"] = {"enabled": True}
    objects = children(body)
    data = objects[("ConfigMap", "llama-config")]["data"]
    shipped = builtin_profile(body["spec"]["model"]["path"])
    assert shipped is not None and data[cmd.BUILTIN_PROFILE] == shipped.read_text()
    # The planner's command line names it, in the ConfigMap the pod mounts; no other volume.
    argv = data["planner.args"].splitlines()
    path = argv[argv.index("--profile") + 1]
    assert path == f"{cmd.CONFIG_DIR}/{cmd.BUILTIN_PROFILE}"
    pod = objects[("Deployment", "llama-planner")]["spec"]["template"]["spec"]
    assert [v["name"] for v in pod["volumes"]] == ["config", "cache"]
    args = build_parser().parse_args(argv)
    args.profile = str(shipped)  # the file the pod reads at `path`
    profile, _config = load_planner(args)
    assert profile == EngineProfile.load(shipped) and "SmolLM2-135M-Instruct.Q4_1.gguf" in profile.source
    # Any other model needs a profile of the user's measuring, and the message says so.
    body["spec"]["model"]["path"] = "/models/SmolLM2-135M-Instruct.Q8_0.gguf"
    with pytest.raises(SpecError, match=r"spec\.planner\.profileConfigMap is required .*`pdserve profile`"):
        parse_spec(body)
