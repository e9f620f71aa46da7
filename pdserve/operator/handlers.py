"""The kopf layer: which events trigger a reconcile, how the operator logs in, and the resync.

Every trigger (an event of a PDServeDeployment, an event of a Deployment or StatefulSet the
operator owns, the periodic resync; a LeaderWorkerSet, an API that may not be installed, is
seen on the resync) only names a resource to reconcile; ``Reconciler`` runs at most one
reconcile per resource at a time and folds triggers that arrive meanwhile into one more run.
The handlers are event handlers, which keep no state on the resource: the operator writes
nothing to a PDServeDeployment but its status, and needs no finalizer.

Load this module with kopf after ``configure`` (``pdserve operator`` does both).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve.extras import missing_extra

try:
    import kopf
    from kubernetes import client as k8s
    from kubernetes.client.exceptions import ApiException
except ModuleNotFoundError as error:
    missing_extra(error, "k8s", "pdserve's operator")

from pdserve.operator.children import DEPLOYMENT_LABEL, MANAGED_BY, OPERATOR
from pdserve.operator.kube import Kube
from pdserve.operator.metrics import OperatorMetrics
from pdserve.operator.reconcile import Settings, reconcile, resync_all
from pdserve.operator.spec import GROUP, PLURAL, VERSION

logger = logging.getLogger(__name__)

RESYNC_S = 15.0
# A failed reconcile is retried after this long, even without a new event.
RETRY_S = 5.0


@dataclass
class Reconciler:
    """Runs reconciles, one at a time per resource, coalescing triggers."""

    configuration: k8s.Configuration
    namespace: str | None
    settings: Settings
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    kube: Kube = field(init=False)
    _dirty: set[tuple[str, str]] = field(default_factory=set)
    _running: dict[tuple[str, str], asyncio.Task] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.kube = Kube(self.configuration)

    def trigger(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        self._dirty.add(key)
        if key not in self._running:
            self._running[key] = asyncio.get_running_loop().create_task(self._run(key), name=f"reconcile {key}")

    async def _run(self, key: tuple[str, str]) -> None:
        try:
            while key in self._dirty:
                self._dirty.discard(key)
                if not await self._once(*key):
                    await asyncio.sleep(RETRY_S)
                    self._dirty.add(key)
        finally:
            del self._running[key]

    async def _once(self, namespace: str, name: str) -> bool:
        started = time.monotonic()
        try:
            await reconcile(self.kube, namespace, name, self.settings)
        except (ApiException, OSError, TimeoutError) as error:
            reason = f"{error.status} {error.reason}: {error.body}" if isinstance(error, ApiException) else repr(error)
            logger.warning("reconcile of %s/%s failed: %s", namespace, name, reason)
            self.metrics.reconciles.labels("error").inc()
            self.metrics.errors.labels(type(error).__name__).inc()
            return False
        finally:
            self.metrics.duration.observe(time.monotonic() - started)
        self.metrics.reconciles.labels("ok").inc()
        return True

    async def resync_forever(self) -> None:
        while True:
            try:
                for namespace, name in await resync_all(self.kube, self.namespace):
                    self.trigger(namespace, name)
            except (ApiException, OSError, TimeoutError) as error:
                logger.warning("resync: listing %s failed: %s", PLURAL, error)
            await asyncio.sleep(RESYNC_S)

    async def close(self) -> None:
        for task in list(self._running.values()):
            task.cancel()
        await asyncio.gather(*self._running.values(), return_exceptions=True)
        await asyncio.to_thread(self.kube.close)


_reconciler: Reconciler | None = None


def configure(reconciler: Reconciler) -> None:
    """Set the reconciler the handlers below use; call before kopf starts."""
    global _reconciler
    _reconciler = reconciler


def _current() -> Reconciler:
    if _reconciler is None:
        raise RuntimeError("pdserve.operator.handlers: configure() was not called before kopf started")
    return _reconciler


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    """The API server the operator was configured for (not the ``kubernetes`` package's
    import-time default, which read ``$KUBECONFIG`` before the command line was parsed)."""
    c = _current().configuration
    # Through the client's own getter: an in-cluster configuration re-reads the rotated token there.
    # (kubernetes >= 37 keeps it under "BearerToken"; a hand-made configuration may use "authorization").
    credential = c.get_api_key_with_prefix("BearerToken") or c.get_api_key_with_prefix("authorization") or ""
    scheme, _space, token = credential.partition(" ") if " " in credential else (None, "", credential)
    return kopf.ConnectionInfo(
        server=c.host,
        ca_path=c.ssl_ca_cert,
        insecure=not c.verify_ssl,
        scheme=scheme,
        token=token or None,
        certificate_path=c.cert_file,
        private_key_path=c.key_file,
    )


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.posting.level = logging.WARNING
    settings.networking.request_timeout = 60
    settings.watching.server_timeout = 300
    memo.resync = asyncio.get_running_loop().create_task(_current().resync_forever(), name="pdserve resync")


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    memo.resync.cancel()
    await asyncio.gather(memo.resync, return_exceptions=True)
    await _current().close()


# Async handlers: kopf runs plain functions in a thread, where there is no loop to start a task on.
@kopf.on.event(GROUP, VERSION, PLURAL)
async def resource_event(name: str, namespace: str | None, type: str | None, **_: Any) -> None:
    assert namespace is not None  # the resource is namespaced
    if type != "DELETED":
        _current().trigger(namespace, name)


@kopf.on.event("apps", "v1", "deployments", labels={MANAGED_BY: OPERATOR})
@kopf.on.event("apps", "v1", "statefulsets", labels={MANAGED_BY: OPERATOR})
async def child_event(labels: Mapping[str, str], namespace: str | None, **_: Any) -> None:
    assert namespace is not None  # Deployments and StatefulSets are namespaced
    owner = labels.get(DEPLOYMENT_LABEL)
    if owner:
        _current().trigger(namespace, owner)
