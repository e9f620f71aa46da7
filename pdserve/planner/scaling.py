"""Scaling connectors: how the planner's decisions reach the machines.

``ScalingConnector`` is the planner's one way to change pool sizes. Knobs travel through
etcd (``knobs_store``), where workers and frontends apply them live; a connector may also
record them where its platform shows them. ``KubernetesConnector`` patches pdserve's custom
resource and leaves the pods to the operator.

The custom resource (group ``pdserve.io``, version ``v1alpha1``, kind ``PDServeDeployment``,
plural ``pdservedeployments``), one per served model::

    spec:
      model: /models/Llama-3.1-8B       # path or name the workers load
      prefill:                          # the prefill pool
        replicas: 2                     # desired; the planner patches this field only
        resources: {...}                # a pod's requests/limits (GPUs per replica)
        engineArgs: {dtype: bfloat16, maxNumBatchedTokens: 2048, ...}  # start-up args
      decode: {replicas: 4, resources: {...}, engineArgs: {maxNumSeqs: 64, ...}}
      frontend: {replicas: 1, port: 8000}
      slo:                              # mirrored into etcd as SLOTargets
        ttftP90: 500ms
        itlP90: 50ms
        e2eP90: 30s                     # optional
        minPrefillReplicas: 1
        maxPrefillReplicas: 8
        minDecodeReplicas: 1
        maxDecodeReplicas: 8
      tuning:                           # live knobs, mirrored here by the planner
        decodeMaxNumSeqs: 64
        decodeMaxNumBatchedTokens: 2048
        prefillChunkSize: 2048
        localPrefillThresholdTokens: 0
      etcd: {endpoints: ["http://etcd:2379"]}   # or absent: the chart's own etcd
    status:
      prefillReady: 2                   # replicas registered in etcd and serving
      decodeReady: 4
      observedGeneration: 7
      conditions: [{type: Available | Progressing | Degraded, status, reason, message}]

For the operator: ``replicas`` of each pool is the only field the planner writes, so a
reconcile loop that owns the rest of ``spec`` never fights it; a pool's replicas are
honoured within the ``slo`` bounds (the planner already keeps to them). A change to
``engineArgs`` rolls the pool's pods; a change to ``tuning`` must not: the planner has
already stored the same knobs in etcd, where the workers apply them live, so ``tuning`` is
there for ``kubectl`` readers and needs no reconciling. Scale-down should drain
(mark the worker draining in etcd, wait for its requests, then delete the pod), never kill.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import Any

from pdserve.discovery.knobs import Knobs

GROUP = "pdserve.io"
VERSION = "v1alpha1"
PLURAL = "pdservedeployments"

# Knobs field → the custom resource's spec.tuning key.
_TUNING_KEYS = {
    "decode_max_num_seqs": "decodeMaxNumSeqs",
    "decode_max_num_batched_tokens": "decodeMaxNumBatchedTokens",
    "prefill_chunk_size": "prefillChunkSize",
    "local_prefill_threshold_tokens": "localPrefillThresholdTokens",
}


class ScalingConnector(ABC):
    """Sets the desired sizes of one model's prefill and decode pools.

    ``scale`` returns once the request is accepted, not when replicas are ready: readiness
    shows up in the planner's next observations. Calls must be idempotent (the planner may
    repeat a decision after a restart).

    ``applies_knobs``: whether the planner stores its knobs in etcd, where workers and
    frontends apply them, for the models this connector manages.
    """

    applies_knobs: bool = True

    @abstractmethod
    async def current(self) -> tuple[int, int] | None:
        """The desired (prefill, decode) replica counts now in force; None when unknown (the
        planner then starts from the workers registered)."""

    @abstractmethod
    async def scale(self, prefill: int, decode: int) -> None:
        """Ask for ``prefill`` and ``decode`` replicas; raises on rejection."""

    async def set_knobs(self, knobs: Knobs) -> None:
        """Record ``knobs`` where this connector's platform shows them (default: nowhere).

        The planner has already stored them in etcd, which is what workers and frontends
        follow; a failure here is logged, and the planner re-reads what is deployed.
        """


class AdviseOnly(ScalingConnector):
    """Applies nothing, knobs included: the planner publishes what it would do (``pdserve
    planner --connector none``)."""

    applies_knobs = False

    def __init__(self) -> None:
        self._sizes: tuple[int, int] | None = None

    async def current(self) -> tuple[int, int] | None:
        return self._sizes

    async def scale(self, prefill: int, decode: int) -> None:
        self._sizes = (prefill, decode)


class KubernetesConnector(ScalingConnector):
    """Patches ``spec.{prefill,decode}.replicas`` (and ``spec.tuning``) of a PDServeDeployment.

    ``api`` is a ``kubernetes.client.CustomObjectsApi``; None creates one on first use from
    the in-cluster service account, else the local kubeconfig. The ``kubernetes`` package is
    a dependency of pdserve (the operator uses it too).
    """

    def __init__(self, name: str, namespace: str = "default", api: Any = None) -> None:
        self.name = name
        self.namespace = namespace
        self._api = api

    def _client(self) -> Any:
        if self._api is None:
            try:
                from kubernetes import client, config
            except ImportError:
                raise RuntimeError("KubernetesConnector needs the kubernetes package: pip install kubernetes") from None
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            self._api = client.CustomObjectsApi()
        return self._api

    async def current(self) -> tuple[int, int]:
        body = await asyncio.to_thread(
            self._client().get_namespaced_custom_object, GROUP, VERSION, self.namespace, PLURAL, self.name
        )
        spec = body.get("spec", {})
        return int(spec.get("prefill", {}).get("replicas", 0)), int(spec.get("decode", {}).get("replicas", 0))

    async def scale(self, prefill: int, decode: int) -> None:
        if prefill < 0 or decode < 0:
            raise ValueError(f"replica counts must be >= 0, got prefill={prefill}, decode={decode}")
        await self._patch({"spec": {"prefill": {"replicas": prefill}, "decode": {"replicas": decode}}})

    async def set_knobs(self, knobs: Knobs) -> None:
        tuning = {key: getattr(knobs, field) for field, key in _TUNING_KEYS.items()}
        await self._patch({"spec": {"tuning": tuning}})

    async def _patch(self, body: dict[str, Any]) -> None:
        # A dict body is sent as a JSON merge patch: only the named fields change.
        await asyncio.to_thread(
            self._client().patch_namespaced_custom_object, GROUP, VERSION, self.namespace, PLURAL, self.name, body
        )
