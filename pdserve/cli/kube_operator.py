"""``pdserve operator``: the Kubernetes operator that deploys PDServeDeployments.

(Not ``operator.py``: that name would shadow the standard library's module.)
"""

from __future__ import annotations

import argparse

from pdserve import environment

from pdserve.extras import missing_extra

DESCRIPTION = """Reconcile PDServeDeployment resources (pdserve.io/v1alpha1): for each, a ConfigMap
with the components' arguments, Deployments for the frontend, the prefill and decode pools and
the planner (LeaderWorkerSets for groups larger than a node), and Services; its status counts
ready replicas and the workers registered in etcd, with Available, Progressing and Degraded
conditions. The CRD and the operator's RBAC come with the Helm chart (charts/pdserve).

In a pod it uses its service account; elsewhere --kubeconfig, else $KUBECONFIG or ~/.kube/config."""

EXAMPLES = """examples:
  pdserve operator --all-namespaces --etcd http://pdserve-etcd:2379
  pdserve operator --kubeconfig ~/.kube/config --namespace llm
  kubectl get pdservedeployments        # MODEL, PREFILL and DECODE ready/desired, AVAILABLE"""


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "operator",
        help="run the Kubernetes operator (PDServeDeployment)",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--kubeconfig", metavar="PATH", help="kubeconfig file (default: in-cluster, else $KUBECONFIG)")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--namespace", metavar="NS", help="watch only this namespace")
    scope.add_argument("--all-namespaces", action="store_true", help="watch every namespace (the default)")
    p.add_argument(
        "--etcd",
        default=environment.etcd_url(),
        metavar="URL",
        help="etcd for deployments whose spec.etcd names none, e.g. the chart's own (default: $PDSERVE_ETCD)",
    )
    p.add_argument(
        "--planner-cluster-role",
        default=environment.planner_cluster_role(),
        metavar="NAME",
        help="the ClusterRole a planner without spec.planner.serviceAccountName is bound to, under a "
        "ServiceAccount NAME-planner the operator makes (the chart ships one and sets "
        "$PDSERVE_PLANNER_CLUSTER_ROLE; default: that variable; unset, such a planner needs its serviceAccountName)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=8080,
        help="Prometheus /metrics port: reconciles, errors, duration (default: 8080; -1: off)",
    )
    p.add_argument(
        "--health-port",
        type=int,
        default=8081,
        help="liveness endpoint http://0.0.0.0:PORT/healthz (default: 8081; -1: off)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        import kopf
    except ModuleNotFoundError as error:
        missing_extra(error, "k8s", "the operator")

    from pdserve.observability.metrics import serve_metrics
    from pdserve.operator import handlers
    from pdserve.operator.kube import load_configuration
    from pdserve.operator.reconcile import Settings

    reconciler = handlers.Reconciler(
        load_configuration(args.kubeconfig),
        args.namespace,
        Settings(args.etcd, planner_cluster_role=args.planner_cluster_role),
    )
    handlers.configure(reconciler)
    if args.metrics_port >= 0:
        serve_metrics(reconciler.metrics.registry, "0.0.0.0", args.metrics_port)
    liveness = f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port >= 0 else None
    kopf.run(
        standalone=True,
        clusterwide=args.namespace is None,
        namespaces=[args.namespace] if args.namespace else [],
        liveness_endpoint=liveness,
    )
    return 0
