"""The Kubernetes operator: PDServeDeployment (pdserve.io/v1alpha1) → pods and status.

- ``spec``: the resource's spec as structs, with the checks its schema cannot express;
- ``args``: the one mapping from spec fields to the components' command lines;
- ``children``: the desired children, computed from the spec alone;
- ``groups``: pools whose worker group spans pods (a LeaderWorkerSet, else a StatefulSet per group);
- ``status``: the status rebuilt from what was observed; ``registry``: what etcd says;
- ``etcd_secrets``: the operator's credentials for a deployment's etcd, from its Secrets;
- ``kube``: JSON calls to the API server; ``reconcile``: one reconcile, end to end;
- ``handlers``: the thin kopf layer (``pdserve operator`` runs it); ``metrics``;
- ``removal``: delete every resource in a scope and wait until its pods are gone (``helm uninstall``'s hook).

The CRD lives in ``charts/pdserve/crds/pdservedeployments.yaml``.
"""
