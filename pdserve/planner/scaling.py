"""Scaling connectors: how the planner's decisions reach the machines.

``ScalingConnector`` is the planner's one way to change pool sizes. Knobs travel through
etcd (``knobs_store``), where workers and frontends apply them live; a connector may also
record them where its platform shows them. ``KubernetesConnector`` patches pdserve's custom
resource and leaves the pods to the operator.

The custom resource (group ``pdserve.io``, version ``v1alpha1``, kind ``PDServeDeployment``,
plural ``pdservedeployments``), one per served model, is defined by the CRD in
``charts/pdserve/crds/pdservedeployments.yaml`` and reconciled by ``pdserve operator``
(``pdserve/operator``). This connector writes only ``spec.prefill.replicas``,
``spec.decode.replicas`` and the ``spec.tuning`` mirror of the knobs; the operator owns the
rest, so the two never fight. A replicas change only resizes a pool (its pods drain in their
preStop before they go); ``tuning`` rolls nothing, since workers already follow the knobs in etcd.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import Any

from pdserve.discovery.knobs import Knobs
from pdserve.extras import missing_extra

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
    the in-cluster service account, else the local kubeconfig. The ``kubernetes`` package comes
    with pdserve's ``k8s`` extra (the operator needs it too).
    """

    def __init__(self, name: str, namespace: str = "default", api: Any = None) -> None:
        self.name = name
        self.namespace = namespace
        self._api = api

    def _client(self) -> Any:
        if self._api is None:
            try:
                from kubernetes import client, config
            except ModuleNotFoundError as error:
                missing_extra(error, "k8s", "the planner's KubernetesConnector")
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
