"""The children a PDServeDeployment should have, computed from its spec alone.

Pure functions: the same resource always gives the same objects (deterministic names, owner
references, labels), so applying them is idempotent. What rolls a pool is its pod template:
it carries a hash of the pool's arguments file, image and the Secrets it mounts or reads, so an
``engineArgs`` change or another Secret makes a new template (a rolling update), while
``replicas`` lives outside the template and only scales.

Secured deployments: ``spec.clusterTLS``'s Secret is mounted into every worker and frontend pod
(the planner calls no worker), ``spec.etcd.tls``'s into every pod that talks to etcd (all of
them), and ``spec.etcd.auth``'s user and password reach the container as env from the Secret.
Secret volumes are readable by the pod's group alone (``fsGroup``).

A planner without ``spec.planner.serviceAccountName`` runs as a ServiceAccount of its own,
``NAME-planner``, which a RoleBinding of the same name binds to the planner ClusterRole that
the chart ships (get and patch on PDServeDeployments, what its Kubernetes connector calls). A
RoleBinding cannot name resources, so the grant covers the namespace's PDServeDeployments, not
only this one; it ends with the resource (owner references) or with the planner (pruned).
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from typing import Any

from pdserve.operator import args as cmd
from pdserve.operator import groups
from pdserve.operator.spec import GROUP, KIND, VERSION, DeploymentSpec, PoolSpec
from pdserve.planner.profile import builtin_profile

DEPLOYMENT_LABEL = "pdserve.io/deployment"
COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY = "app.kubernetes.io/managed-by"
OPERATOR = "pdserve-operator"
CONFIG_HASH = "pdserve.io/config-hash"
POOLS = ("prefill", "decode")


@dataclass(frozen=True)
class Owner:
    """The custom resource the children belong to."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def of(cls, body: dict[str, Any]) -> Owner:
        meta = body["metadata"]
        return cls(meta["name"], meta["namespace"], meta["uid"])


def child_name(owner: Owner, component: str) -> str:
    return f"{owner.name}-{component}"


def labels(owner: Owner, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "pdserve",
        "app.kubernetes.io/instance": owner.name,
        COMPONENT_LABEL: component,
        MANAGED_BY: OPERATOR,
        DEPLOYMENT_LABEL: owner.name,
    }


def selector(owner: Owner, component: str) -> dict[str, str]:
    return {DEPLOYMENT_LABEL: owner.name, COMPONENT_LABEL: component}


def metadata(owner: Owner, name: str, component: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels(owner, component),
        "ownerReferences": [
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": KIND,
                "name": owner.name,
                "uid": owner.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }


def config_files(spec: DeploymentSpec, owner: Owner, etcd: str) -> dict[str, str]:
    """The ConfigMap's files: each component's arguments (``pdserve @FILE``)."""
    files = {role: cmd.worker_args(spec, role, etcd) for role in POOLS}
    files["frontend"] = cmd.frontend_args(spec, etcd)
    if spec.planner.enabled:
        files["planner"] = cmd.planner_args(spec, owner.namespace, owner.name, etcd)
    data = {f"{component}.args": cmd.args_file(argv) for component, argv in files.items()}
    if spec.planner.enabled and not spec.planner.profile_config_map:
        profile = builtin_profile(spec.model.path)
        assert profile is not None  # check_spec: a profileConfigMap, or a model with a profile shipped
        data[cmd.BUILTIN_PROFILE] = profile.read_text()
    return data


def config_map(owner: Owner, files: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(owner, child_name(owner, "config"), "config"),
        "data": files,
    }


# Server-side apply merges port lists by (port, protocol) and types quantities as strings; an
# applied object must spell both out (the API server's defaulting does not run before the merge).
def _port(name: str, port: int) -> dict[str, Any]:
    return {"name": name, "containerPort": port, "protocol": "TCP"}


def _service_port(name: str, port: int) -> dict[str, Any]:
    return {"name": name, "port": port, "targetPort": name, "protocol": "TCP"}


# Every pod's probes, on its metrics port (README: Health probes), in one place. /livez fails
# until the model is loaded and warmed up (the port opens only after the load), so the startup
# probe is what waits for a big model: 10 s apart, 30 minutes in all; liveness starts only once
# it has passed, and restarts a pod after three misses in a row, on top of the worker's own
# --liveness-deadline. /readyz passes once the worker is registered in etcd and not draining
# (the frontend: once it sees a serving worker of each pool it needs).
_PROBE_TIMEOUT_S = 5
_STARTUP = {"periodSeconds": 10, "failureThreshold": 180}
_LIVENESS = {"periodSeconds": 10, "failureThreshold": 3}
_READINESS = {"periodSeconds": 5, "failureThreshold": 2}


def probes() -> dict[str, dict[str, Any]]:
    """The container's startup, liveness and readiness probes (keys of a container spec)."""

    def get(path: str, timing: dict[str, int]) -> dict[str, Any]:
        action = {"path": path, "port": cmd.METRICS_PORT, "scheme": "HTTP"}
        return {"httpGet": action, "timeoutSeconds": _PROBE_TIMEOUT_S, **timing}

    return {
        "startupProbe": get("/livez", _STARTUP),
        "livenessProbe": get("/livez", _LIVENESS),
        "readinessProbe": get("/readyz", _READINESS),
    }


def _quantities(resources: dict[str, Any]) -> dict[str, Any]:
    """``limits: {nvidia.com/gpu: 8}`` as ``"8"``: a quantity is a string in the API's schema."""
    return {
        key: {k: str(v) for k, v in value.items()} if isinstance(value, dict) else value
        for key, value in resources.items()
    }


# Secret files: read by the pod's user through fsGroup, by no one else in the container.
_SECRET_MODE = 0o440


def _secret_volume(volumes: list[dict], mounts: list[dict], name: str, secret: str, path: str) -> None:
    volumes.append({"name": name, "secret": {"secretName": secret, "defaultMode": _SECRET_MODE}})
    mounts.append({"name": name, "mountPath": path, "readOnly": True})


def _volumes(spec: DeploymentSpec, owner: Owner, component: str) -> tuple[list[dict], list[dict]]:
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": child_name(owner, "config")}},
        {"name": "cache", "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": cmd.CONFIG_DIR, "readOnly": True},
        {"name": "cache", "mountPath": "/home/pdserve/.cache"},
    ]
    source = spec.model.volume
    # The frontend reads the tokenizer from the model the workers registered (the same path).
    if component in (*POOLS, "frontend") and source is not None:
        volume: dict[str, Any] = {"name": "model"}
        if source.pvc is not None:
            volume["persistentVolumeClaim"] = {"claimName": source.pvc.claim_name, "readOnly": source.pvc.read_only}
        else:
            assert source.host_path is not None  # check_spec: exactly one
            volume["hostPath"] = {"path": source.host_path.path, "type": "Directory"}
        volumes.append(volume)
        mounts.append({"name": "model", "mountPath": source.mount_path, "readOnly": True})
    if component == "frontend" and spec.tls is not None:
        volumes.append({"name": "tls", "secret": {"secretName": spec.tls.secret_name}})
        mounts.append({"name": "tls", "mountPath": cmd.TLS_DIR, "readOnly": True})
    if component == "frontend" and spec.api_keys is not None:
        volumes.append({"name": "api-key", "secret": {"secretName": spec.api_keys.secret_name}})
        mounts.append({"name": "api-key", "mountPath": cmd.API_KEY_DIR, "readOnly": True})
    if component in (*POOLS, "frontend") and spec.cluster_tls is not None:
        _secret_volume(volumes, mounts, "cluster-tls", spec.cluster_tls.secret_name, cmd.CLUSTER_TLS_DIR)
    if spec.etcd.tls is not None:
        _secret_volume(volumes, mounts, "etcd-tls", spec.etcd.tls.secret_name, cmd.ETCD_TLS_DIR)
    if component == "planner" and spec.planner.profile_config_map:
        volumes.append({"name": "profile", "configMap": {"name": spec.planner.profile_config_map}})
        mounts.append({"name": "profile", "mountPath": cmd.PROFILE_DIR, "readOnly": True})
    return volumes, mounts


def pod_template(spec: DeploymentSpec, owner: Owner, component: str, files: dict[str, str]) -> dict[str, Any]:
    """The pod of one component; its hash annotation covers everything that should roll it."""
    volumes, mounts = _volumes(spec, owner, component)
    argv = [f"@{cmd.CONFIG_DIR}/{component}.args"]
    container: dict[str, Any] = {
        "name": component,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "args": argv,
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            *cmd.etcd_env(spec),
        ],
        "volumeMounts": mounts,
        "ports": [_port("metrics", cmd.METRICS_PORT)],
    }
    pod: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 1000},
    }
    if component in POOLS:
        pool: PoolSpec = getattr(spec, component)
        container["args"] = argv + cmd.pod_worker_args()
        container["ports"].append(_port("grpc", cmd.WORKER_PORT))
        container.update(probes())
        container["lifecycle"] = {"preStop": {"exec": {"command": cmd.prestop_command(spec, component)}}}
        if pool.resources:
            container["resources"] = _quantities(pool.resources)
        pod["terminationGracePeriodSeconds"] = cmd.grace_seconds(pool, component)
        if pool.node_selector:
            pod["nodeSelector"] = pool.node_selector
        if pool.tolerations:
            pod["tolerations"] = pool.tolerations
    elif component == "frontend":
        container["ports"] += [_port("grpc", spec.frontend.grpc_port), _port("http", spec.frontend.http_port)]
        container.update(probes())
    if component == "planner":
        pod["serviceAccountName"] = spec.planner.service_account_name or child_name(owner, "planner")
    inputs = f"{spec.image}\n{files.get(f'{component}.args', '')}"
    secrets = _secret_names(pod)
    if secrets:  # without any, the hash of a deployment made before Secrets counted
        inputs += "\nsecrets: " + ",".join(secrets)
    digest = hashlib.sha256(inputs.encode()).hexdigest()[:16]
    return {"metadata": {"labels": labels(owner, component), "annotations": {CONFIG_HASH: digest}}, "spec": pod}


def _secret_names(pod: dict[str, Any]) -> list[str]:
    """Every Secret the pod mounts or takes env from."""
    names = {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    for container in pod["containers"]:
        names |= {
            e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})
        }
    return sorted(names)


def deployment(spec: DeploymentSpec, owner: Owner, component: str, replicas: int, files: dict[str, str]) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(owner, child_name(owner, component), component),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector(owner, component)},
            # Surge first, remove after: a rolling pool never drops below its size, and each
            # removed pod drains (preStop) before it goes.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": pod_template(spec, owner, component, files),
        },
    }


def group_workloads(spec: DeploymentSpec, owner: Owner, role: str, lws: bool, files: dict[str, str]) -> list[dict]:
    """A pool whose group spans pods (``groups``): its LeaderWorkerSet, else each group's
    StatefulSet and headless Service (``replicas`` of each: scaling adds or removes groups)."""
    pool: PoolSpec = getattr(spec, role)
    template = pod_template(spec, owner, role, files)
    if lws:
        return [
            groups.leader_worker_set(
                metadata(owner, child_name(owner, role), role), pool.replicas, pool.ranks, template
            )
        ]
    objects = []
    for index in range(pool.replicas):
        name = groups.group_name(child_name(owner, role), index)
        group = {groups.GROUP_LABEL: str(index)}
        meta = metadata(owner, name, role)
        meta["labels"] |= group
        pods = copy.deepcopy(template)
        pods["metadata"]["labels"] |= group
        chosen = selector(owner, role) | group
        objects.append(groups.stateful_set(meta, chosen, pool.ranks, pods, owner.namespace))
        objects.append(groups.headless_service(copy.deepcopy(meta), chosen))
    return objects


def service(spec: DeploymentSpec, owner: Owner, component: str) -> dict[str, Any]:
    """The frontend's Service (the public API); a headless one per pool and for the planner (metrics scraping)."""
    if component == "frontend":
        ports = [
            _service_port("grpc", spec.frontend.grpc_port),
            _service_port("http", spec.frontend.http_port),
            _service_port("metrics", cmd.METRICS_PORT),
        ]
        body: dict[str, Any] = {"type": spec.frontend.service_type, "ports": ports}
        name = owner.name
    else:
        body = {"clusterIP": "None", "ports": [_service_port("metrics", cmd.METRICS_PORT)]}
        name = child_name(owner, component)
    body["selector"] = selector(owner, component)
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata(owner, name, component), "spec": body}


def planner_service_account(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": metadata(owner, child_name(owner, "planner"), "planner"),
    }


def planner_role_binding(owner: Owner, cluster_role: str) -> dict[str, Any]:
    """Binds the planner's own ServiceAccount to ``cluster_role`` in the resource's namespace."""
    name = child_name(owner, "planner")
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": metadata(owner, name, "planner"),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_role},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}],
    }


def desired_children(
    spec: DeploymentSpec, owner: Owner, etcd: str, lws_installed: bool, planner_role: str | None = None
) -> list[dict[str, Any]]:
    """Every child. ``lws_installed``: whether a pool whose group spans pods runs as a
    LeaderWorkerSet (else as a StatefulSet per group); ``planner_role``: the ClusterRole a
    planner without a service account of its own is bound to."""
    files = config_files(spec, owner, etcd)
    objects = [config_map(owner, files)]
    objects.append(deployment(spec, owner, "frontend", spec.frontend.replicas, files))
    objects.append(service(spec, owner, "frontend"))
    for role in POOLS:
        pool: PoolSpec = getattr(spec, role)
        if pool.multi_node:
            objects += group_workloads(spec, owner, role, lws_installed, files)
        else:
            objects.append(deployment(spec, owner, role, pool.replicas, files))
        objects.append(service(spec, owner, role))
    if spec.planner.enabled and not spec.planner.service_account_name:
        if planner_role is None:
            raise ValueError(
                "spec.planner.serviceAccountName is required: this operator has no planner ClusterRole to "
                "bind one to (the chart gives it one: --planner-cluster-role, $PDSERVE_PLANNER_CLUSTER_ROLE)"
            )
        objects += [planner_service_account(owner), planner_role_binding(owner, planner_role)]
    if spec.planner.enabled:
        objects.append(deployment(spec, owner, "planner", 1, files))
        objects.append(service(spec, owner, "planner"))  # scraped for the SLO targets and decisions
    return objects
