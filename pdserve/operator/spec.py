"""A PDServeDeployment's spec as typed structs, decoded from the custom resource.

The CRD's OpenAPI schema (charts/pdserve/crds/pdservedeployments.yaml) is what the API
server enforces; these structs are the operator's reading of the same fields, with the same
defaults, plus the checks a v1.20 schema cannot express (no CEL rules there): a spec that
decodes but cannot be deployed raises ``SpecError`` naming the field, which the operator
reports as the ``Degraded`` condition instead of crashing.
"""

from __future__ import annotations

import posixpath
import re
from typing import Any, Literal

import msgspec

from pdserve.planner.profile import builtin_profile

GROUP = "pdserve.io"
VERSION = "v1alpha1"
KIND = "PDServeDeployment"
PLURAL = "pdservedeployments"

ServiceType = Literal["ClusterIP", "NodePort", "LoadBalancer"]
Disaggregation = Literal["always", "conditional", "off"]
EngineArg = str | int | float | bool


class SpecError(ValueError):
    """The spec cannot be deployed; the message names the field."""


class _Camel(msgspec.Struct, frozen=True, kw_only=True, rename="camel", forbid_unknown_fields=True):
    pass


class PvcSource(_Camel, frozen=True):
    claim_name: str
    read_only: bool = True


class HostPathSource(_Camel, frozen=True):
    path: str


class ModelVolume(_Camel, frozen=True):
    """Where the model's files come from: a PersistentVolumeClaim, or a node's model cache
    (a host path); mounted at ``mount_path``."""

    pvc: PvcSource | None = None
    host_path: HostPathSource | None = None
    mount_path: str = "/models"


class ModelSpec(_Camel, frozen=True):
    path: str
    name: str | None = None
    volume: ModelVolume | None = None

    @property
    def served_name(self) -> str:
        """The name workers register under (pdserve's default: the directory's name)."""
        return self.name or posixpath.basename(self.path.rstrip("/"))


class PoolSpec(_Camel, frozen=True):
    replicas: int = 1
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    gpus_per_node: int = 8
    resources: dict[str, Any] = {}
    node_selector: dict[str, str] = {}
    tolerations: list[dict[str, Any]] = []
    # Checked by check_spec (msgspec would not name the offending key).
    engine_args: dict[str, Any] = {}

    @property
    def ranks(self) -> int:
        """Ranks in one worker group (one replica)."""
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def multi_node(self) -> bool:
        """Whether one group needs more GPUs than a node has: then it runs one rank a pod
        (``operator/groups.py``), else all its ranks in one pod."""
        return self.ranks > self.gpus_per_node


class FrontendSpec(_Camel, frozen=True):
    replicas: int = 1
    service_type: ServiceType = "ClusterIP"
    grpc_port: int = 50051
    http_port: int = 8000
    args: dict[str, Any] = {}


class RouterSpec(_Camel, frozen=True):
    disaggregation: Disaggregation | None = None
    local_prefill_threshold_tokens: int | None = None
    prefill_saturation_tokens: int | None = None


class SloSpec(_Camel, frozen=True):
    ttft_p90: str | None = None
    itl_p90: str | None = None
    e2e_p90: str | None = None
    min_prefill_replicas: int = 1
    max_prefill_replicas: int = 8
    min_decode_replicas: int = 1
    max_decode_replicas: int = 8


class PlannerSpec(_Camel, frozen=True):
    enabled: bool = False
    interval: str | None = None
    profile_config_map: str | None = None
    service_account_name: str | None = None


class TlsSpec(_Camel, frozen=True):
    secret_name: str


class EtcdTlsSpec(_Camel, frozen=True):
    """A Secret with the CA etcd's certificate chains to (``ca.crt``) and, with
    ``client_certificate``, the certificate and key pdserve presents (``tls.crt``, ``tls.key``)."""

    secret_name: str
    client_certificate: bool = False


class EtcdSpec(_Camel, frozen=True):
    endpoints: list[str] = []
    tls: EtcdTlsSpec | None = None
    # A Secret with keys ``username`` and ``password``: the etcd user every component signs in as.
    auth: TlsSpec | None = None
    server_name: str | None = None


class ApiKeySpec(_Camel, frozen=True):
    secret_name: str
    key: str = "api-key"


class DeploymentSpec(_Camel, frozen=True):
    model: ModelSpec
    image: str
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    prefill: PoolSpec = PoolSpec()
    decode: PoolSpec = PoolSpec()
    frontend: FrontendSpec = FrontendSpec()
    router: RouterSpec = RouterSpec()
    slo: SloSpec = SloSpec()
    planner: PlannerSpec = PlannerSpec()
    etcd: EtcdSpec = EtcdSpec()
    tls: TlsSpec | None = None
    api_keys: ApiKeySpec | None = None
    cluster_tls: TlsSpec | None = msgspec.field(default=None, name="clusterTLS")
    tuning: dict[str, Any] = {}


_ENGINE_ARG = re.compile(r"^[a-z][a-zA-Z0-9]*$")


def parse_spec(body: dict[str, Any]) -> DeploymentSpec:
    """The custom resource's ``spec``, decoded and checked; SpecError names the bad field."""
    try:
        spec = msgspec.convert(body.get("spec") or {}, DeploymentSpec)
    except msgspec.ValidationError as error:
        # msgspec says "... - at `$.prefill.replicas`"; the field reads better as spec.prefill.replicas.
        raise SpecError(str(error).replace("`$", "`spec")) from None
    check_spec(spec)
    return spec


def check_spec(spec: DeploymentSpec) -> None:
    """What the CRD's schema cannot say; SpecError naming the field."""
    if not spec.model.path.startswith("/"):
        raise SpecError(f"spec.model.path must be an absolute path in the pod, got {spec.model.path!r}")
    volume = spec.model.volume
    if volume is not None:
        if (volume.pvc is None) == (volume.host_path is None):
            raise SpecError("spec.model.volume needs exactly one of pvc and hostPath")
        mount = volume.mount_path.rstrip("/")
        if spec.model.path != mount and not spec.model.path.startswith(mount + "/"):
            raise SpecError(f"spec.model.path {spec.model.path!r} is not under spec.model.volume.mountPath {mount!r}")
    for role in ("prefill", "decode"):
        pool: PoolSpec = getattr(spec, role)
        for name in ("tensor_parallel_size", "data_parallel_size", "gpus_per_node"):
            if getattr(pool, name) < 1:
                raise SpecError(f"spec.{role}.{_camel(name)} must be >= 1, got {getattr(pool, name)}")
        if pool.replicas < 0:
            raise SpecError(f"spec.{role}.replicas must be >= 0, got {pool.replicas}")
        if pool.data_parallel_size > 1 and not pool.enable_expert_parallel:
            raise SpecError(
                f"spec.{role}.dataParallelSize {pool.data_parallel_size} is data-parallel attention for "
                "MoE models: it needs enableExpertParallel: true"
            )
        _check_options(pool.engine_args, f"spec.{role}.engineArgs")
        if pool.multi_node:
            _check_one_gpu_a_pod(pool, role)
    _check_options(spec.frontend.args, "spec.frontend.args")
    slo = spec.slo
    for role in ("prefill", "decode"):
        low, high = getattr(slo, f"min_{role}_replicas"), getattr(slo, f"max_{role}_replicas")
        if not 1 <= low <= high:
            raise SpecError(
                f"spec.slo: min{role.title()}Replicas ({low}) must be in [1, max{role.title()}Replicas ({high})]"
            )
    if spec.planner.enabled and not spec.planner.profile_config_map and builtin_profile(spec.model.path) is None:
        raise SpecError(
            "spec.planner.profileConfigMap is required when spec.planner.enabled is true (pdserve ships a "
            "profile for its default model alone): a ConfigMap with the engine profile, measured on the "
            "pools' hardware (`pdserve profile` writes one), under key profile.json"
        )
    _check_etcd(spec.etcd)
    for where, ref in (
        ("spec.tls", spec.tls),
        ("spec.apiKeys", spec.api_keys),
        ("spec.clusterTLS", spec.cluster_tls),
        ("spec.etcd.tls", spec.etcd.tls),
        ("spec.etcd.auth", spec.etcd.auth),
    ):
        if ref is not None and not ref.secret_name:
            raise SpecError(f"{where}.secretName must name a Secret in the deployment's namespace")


def _check_etcd(etcd: EtcdSpec) -> None:
    if len(etcd.endpoints) > 1:
        raise SpecError(
            "spec.etcd.endpoints: pdserve connects to one etcd endpoint (a Service in front of "
            f"the cluster); got {len(etcd.endpoints)}"
        )
    secured = [name for name in ("tls", "auth", "server_name") if getattr(etcd, name) is not None]
    if not etcd.endpoints:
        if secured:
            raise SpecError(
                f"spec.etcd.{_camel(secured[0])} is for an etcd of the deployment's own: name it in spec.etcd.endpoints"
            )
        return
    endpoint = etcd.endpoints[0]
    if not endpoint.startswith("https://"):
        for name in ("tls", "server_name"):
            if getattr(etcd, name) is not None:
                raise SpecError(
                    f"spec.etcd.{_camel(name)} needs an https:// endpoint, but spec.etcd.endpoints names {endpoint!r}"
                )


def _check_one_gpu_a_pod(pool: PoolSpec, role: str) -> None:
    """A group larger than a node runs one rank a pod: ``resources`` asks for one rank's GPUs."""
    for kind in ("limits", "requests"):
        quantities = pool.resources.get(kind) or {}
        for key, value in quantities.items() if isinstance(quantities, dict) else ():
            if key.endswith("/gpu") and str(value) != "1":
                raise SpecError(
                    f"spec.{role}.resources.{kind}.{key}: a group of {pool.ranks} ranks is larger than a node "
                    f"({pool.gpus_per_node} GPUs) and runs one rank a pod, so a pod takes 1 GPU; got {value}"
                )


def _check_options(values: dict[str, Any], where: str) -> None:
    for key, value in values.items():
        if not _ENGINE_ARG.match(key):
            raise SpecError(f"{where}.{key}: keys are camelCase option names, e.g. maxNumSeqs")
        if not isinstance(value, EngineArg):
            raise SpecError(f"{where}.{key}: expected a string, number or boolean, got {type(value).__name__}")


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)
