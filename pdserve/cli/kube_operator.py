"""``pdserve operator``: the Kubernetes operator that deploys PDServeDeployments; and
``pdserve remove-deployments``, which deletes them all and waits until their pods are gone
(what ``helm uninstall`` of the chart runs first).

(Not ``operator.py``: that name would shadow the standard library's module.)
"""

from __future__ import annotations

import argparse
import sys

from pdserve import environment
from pdserve.cli.common import positive_duration
from pdserve.extras import missing_extra

DESCRIPTION = """Reconcile PDServeDeployment resources (pdserve.io/v1alpha1): for each, a ConfigMap
with the components' arguments, Deployments for the frontend, the prefill and decode pools and
the planner, and Services. A pool whose worker group is larger than a node runs one rank a pod:
a LeaderWorkerSet where that API is installed, else a StatefulSet and a headless Service per
group; its status counts
ready replicas and the workers registered in etcd, with Available, Progressing and Degraded
conditions. The CRD and the operator's RBAC come with the Helm chart (charts/pdserve).

In a pod it uses its service account; elsewhere --kubeconfig, else $KUBECONFIG or ~/.kube/config.
`helm uninstall` first runs `pdserve remove-deployments` (a pre-delete hook) while the operator
still runs, so no PDServeDeployment, and no pod of one, outlives the chart."""

EXAMPLES = """examples:
  pdserve operator --all-namespaces --etcd http://pdserve-etcd:2379
  pdserve operator --kubeconfig ~/.kube/config --namespace llm
  kubectl get pdservedeployments        # MODEL, PREFILL and DECODE ready/desired, AVAILABLE
  pdserve remove-deployments --namespace llm --timeout 5m   # delete them all and wait"""

# A worker pod's grace period is its pool's drain deadline plus its KV deadline plus 15 s
# (operator/args.py's grace_seconds: 105 s with the defaults); this leaves room for a second one.
REMOVE_TIMEOUT = "240s"

REMOVE_DESCRIPTION = """Delete every PDServeDeployment in the scope (every namespace unless --namespace) and wait
until they and their children are gone: Deployments, StatefulSets and LeaderWorkerSets, Services, ConfigMaps,
and the pods, each of which drains first (its preStop). The garbage collector removes the
children; the operator and etcd must still run meanwhile, for the drains. The chart's
pre-delete hook runs this, so `helm uninstall` leaves no pdserve object or process behind
(the CRD stays, as Helm leaves every CRD of a chart's crds/).

It prints each deletion and, whenever it changes and every 10 s, what it still waits for.
exit status: 0 all gone; 1 the deadline passed first (naming what is left), the API server
kept failing, or it refused a call (403: the RBAC it needs is in the chart's uninstall-hook.yaml);
2 bad arguments."""

REMOVE_EXAMPLES = """examples:
  pdserve remove-deployments --all-namespaces
  pdserve remove-deployments --kubeconfig ~/.kube/config --namespace llm --timeout 5m"""


def add_scope_args(parser: argparse.ArgumentParser, one: str, every: str) -> None:
    """Where the API server is and which namespaces a command acts on."""
    parser.add_argument("--kubeconfig", metavar="PATH", help="kubeconfig file (default: in-cluster, else $KUBECONFIG)")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--namespace", metavar="NS", help=one)
    scope.add_argument("--all-namespaces", action="store_true", help=every)


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "operator",
        help="run the Kubernetes operator (PDServeDeployment)",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_scope_args(p, "watch only this namespace", "watch every namespace (the default)")
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

    r = commands.add_parser(
        "remove-deployments",
        help="delete every PDServeDeployment and wait until their pods are gone (helm uninstall's hook)",
        description=REMOVE_DESCRIPTION,
        epilog=REMOVE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_scope_args(r, "only this namespace (the operator's --namespace)", "every namespace (the default)")
    r.add_argument(
        "--timeout",
        type=positive_duration,
        default=REMOVE_TIMEOUT,
        metavar="DURATION",
        help="how long to wait until everything is gone, e.g. 90s, 5m (default: %(default)s)",
    )
    r.set_defaults(func=remove)


def remove(args: argparse.Namespace) -> int:
    from pdserve.operator.kube import Kube, load_configuration
    from pdserve.operator.removal import RemovalError, remove_deployments

    kube = Kube(load_configuration(args.kubeconfig))
    try:
        remove_deployments(kube, args.namespace, args.timeout, lambda line: print(line, flush=True))
    except RemovalError as error:
        print(f"pdserve remove-deployments: error: {error}", file=sys.stderr, flush=True)
        return 1
    finally:
        kube.close()
    return 0


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
