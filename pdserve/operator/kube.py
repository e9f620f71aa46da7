"""A thin, typed-enough client of the Kubernetes API: JSON in, JSON out, every call under a deadline.

The operator works on plain dicts (the objects as the API server serves them) rather than the
``kubernetes`` package's generated models, so an object from a newer or older server round-trips
whole. Writes of children are server-side applies with one field manager: applying the same
object twice changes nothing (no new resourceVersion, no event), which is what keeps the
level-triggered reconcile from looping on its own writes.
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.extras import missing_extra

try:
    from kubernetes import client as k8s
    from kubernetes import config as k8s_config
    from kubernetes.client.exceptions import ApiException
except ModuleNotFoundError as error:
    missing_extra(error, "k8s", "pdserve's operator")

FIELD_MANAGER = "pdserve-operator"
# The longest one API call may take; a reconcile fails (and is retried) past it.
CALL_TIMEOUT_S = 10.0

# kind → (API path prefix, plural) of every kind the operator reads or writes.
KINDS: dict[str, tuple[str, str]] = {
    "ConfigMap": ("/api/v1", "configmaps"),
    "Pod": ("/api/v1", "pods"),
    "Secret": ("/api/v1", "secrets"),
    "Service": ("/api/v1", "services"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "StatefulSet": ("/apis/apps/v1", "statefulsets"),
    "PDServeDeployment": ("/apis/pdserve.io/v1alpha1", "pdservedeployments"),
    "LeaderWorkerSet": ("/apis/leaderworkerset.x-k8s.io/v1", "leaderworkersets"),
}


def load_configuration(kubeconfig: str | None = None) -> k8s.Configuration:
    """The API server's address and credentials: ``kubeconfig`` when given, else the pod's
    service account when running in a cluster, else ``$KUBECONFIG`` / ``~/.kube/config``."""
    configuration = k8s.Configuration()
    if kubeconfig:
        k8s_config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        return configuration
    try:
        k8s_config.load_incluster_config(client_configuration=configuration)
    except k8s_config.ConfigException:
        k8s_config.load_kube_config(client_configuration=configuration)
    return configuration


def object_path(kind: str, namespace: str | None, name: str | None = None) -> str:
    """``/apis/apps/v1/namespaces/NS/deployments/NAME`` and the like."""
    prefix, plural = KINDS[kind]
    path = f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"
    return f"{path}/{name}" if name else path


class Kube:
    """Blocking JSON calls to one API server (run them in a thread from async code)."""

    def __init__(self, configuration: k8s.Configuration) -> None:
        self.api = k8s.ApiClient(configuration)

    def close(self) -> None:
        self.api.close()

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        """One call; the decoded JSON reply. ApiException on an error status."""
        request = self.api.param_serialize(
            method,
            path,
            query_params=list((query or {}).items()),
            header_params={"Accept": "application/json", "Content-Type": content_type},
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self.api.call_api(*request, _request_timeout=CALL_TIMEOUT_S)
        data = response.read()
        if not 200 <= response.status < 300:
            raise ApiException(status=response.status, reason=response.reason, body=data.decode(errors="replace"))
        return json.loads(data) if data else {}

    def get(self, path: str) -> dict[str, Any] | None:
        """The object at ``path``; None when it does not exist."""
        try:
            return self.request("GET", path)
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def list(self, path: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        query = {"labelSelector": label_selector} if label_selector else None
        return self.request("GET", path, query=query).get("items", [])

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply ``obj`` (created when missing), taking over the fields it sets."""
        meta = obj["metadata"]
        path = object_path(obj["kind"], meta.get("namespace"), meta["name"])
        return self.request(
            "PATCH",
            path,
            body=obj,
            query={"fieldManager": FIELD_MANAGER, "force": "true"},
            content_type="application/apply-patch+yaml",
        )

    def patch_status(self, path: str, status: dict[str, Any]) -> dict[str, Any]:
        """Replace the fields of ``status`` named in it (a JSON merge patch of the status subresource)."""
        return self.request(
            "PATCH", f"{path}/status", body={"status": status}, content_type="application/merge-patch+json"
        )

    def merge_patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.request("PATCH", path, body=body, content_type="application/merge-patch+json")

    def delete(self, path: str) -> None:
        """Delete the object at ``path``, its dependents in the background; a missing one is fine."""
        try:
            self.request("DELETE", path, body={"propagationPolicy": "Background"})
        except ApiException as error:
            if error.status != 404:
                raise
