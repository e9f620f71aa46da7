"""``pdserve planner``: hold every model's SLO with the fewest replicas, from outside the pools."""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from pdserve.cli.common import etcd_auth, positive_duration
from pdserve.cli.operate import add_etcd_arg
from pdserve.planner.config import PlannerConfig

if TYPE_CHECKING:
    from pdserve.planner.profile import EngineProfile
    from pdserve.planner.scaling import ScalingConnector

DESCRIPTION = """Every interval, for each model with SLO targets in etcd (`pdserve slo set`):
read the frontends' live stats and the workers' loads, forecast the load (bursts included),
predict TTFT and ITL p90 from the engine profile, and resize the prefill and decode pools
(within the SLO's min/max replicas; up at once, down only after a 6-interval cool-down
judged at that window's peak, doubled up to 36 when a shrink is undone within 30 intervals;
at most 16 replicas requested and not ready per pool; a replica's first 2 ready intervals
scale nothing by their latency alone; an interval with no frontend stats changes nothing); where
pools are at their maximum, retune the model's knobs (`pdserve knobs --help`). Every
decision is logged with its reasons and published in etcd for `pdserve status`.

--connector kubernetes patches the replicas of each model's PDServeDeployment (pdserve.io/
v1alpha1) and stores the knobs in etcd, where workers and frontends apply them live;
--connector none only advises (decisions are published, nothing is resized or retuned).
`pdserve up --autoscale` runs the same planner over local worker processes."""

EXAMPLES = """examples:
  pdserve profile --model ./Llama-3.1-8B --out llama.profile.json
  pdserve slo set --model Llama-3.1-8B --ttft-p90 500ms --itl-p90 30ms --max-decode 8
  pdserve planner --etcd http://etcd:2379 --profile llama.profile.json --connector kubernetes
"""


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "planner",
        help="resize the pools to hold each model's SLO",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_etcd_arg(p)
    add_planner_args(p)
    p.add_argument(
        "--connector",
        choices=["kubernetes", "none"],
        default="none",
        help="how decisions are applied (default: none, advise only)",
    )
    p.add_argument("--namespace", default="default", help="kubernetes: the PDServeDeployments' namespace")
    p.add_argument(
        "--deployment",
        action="append",
        default=[],
        metavar="MODEL=NAME",
        help="kubernetes: the PDServeDeployment of MODEL (default: the model name, lower-cased, "
        "other characters as '-'); repeatable",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=-1,
        help="Prometheus /metrics port: each model's SLO targets, wanted replicas and decisions (default: -1, off)",
    )
    p.set_defaults(func=run)


def add_planner_args(parser: argparse.ArgumentParser) -> None:
    """The options every planner takes (also ``pdserve up --autoscale``)."""
    parser.add_argument(
        "--profile",
        metavar="FILE",
        help="the engine profile the latency model predicts from (`pdserve profile` writes one)",
    )
    parser.add_argument(
        "--planner-interval",
        type=positive_duration,
        metavar="DURATION",
        help="how often the planner observes and decides (default: --planner-config's interval_s, "
        f"else {PlannerConfig.interval_s:g}s; match the frontends' --stats-window)",
    )
    parser.add_argument(
        "--planner-config",
        metavar="FILE",
        help="JSON with PlannerConfig fields to override (margins, cool-downs, forecast: {...})",
    )


def load_planner(args: argparse.Namespace) -> tuple[EngineProfile, PlannerConfig]:
    """The profile and the planner configuration the options name; ValueError naming the bad file or field."""
    from pdserve.planner.profile import EngineProfile

    if not args.profile:
        raise ValueError("--profile is required: measure one with `pdserve profile --model DIR --out FILE`")
    try:
        profile = EngineProfile.load(args.profile)
    except (OSError, ValueError, msgspec.DecodeError) as error:
        raise ValueError(f"--profile {args.profile}: {error}") from None
    overrides = {}
    if args.planner_config:
        try:
            overrides = msgspec.json.decode(Path(args.planner_config).read_bytes())
        except (OSError, msgspec.DecodeError) as error:
            raise ValueError(f"--planner-config {args.planner_config}: {error}") from None
        if not isinstance(overrides, dict):
            raise ValueError(f"--planner-config {args.planner_config}: expected a JSON object")
    if args.planner_interval is not None:
        overrides["interval_s"] = args.planner_interval
    try:
        config = msgspec.convert(overrides, PlannerConfig)
    except (msgspec.ValidationError, ValueError) as error:
        raise ValueError(f"--planner-config {args.planner_config}: {error}") from None
    return profile, config


def kubernetes_name(model: str) -> str:
    """A model name as a Kubernetes object name: lower case, other characters as '-'."""
    return re.sub(r"[^a-z0-9.-]+", "-", model.lower()).strip("-.") or "model"


def run(args: argparse.Namespace) -> int:
    from pdserve.observability.metrics import serve_metrics
    from pdserve.planner.scaling import AdviseOnly, KubernetesConnector
    from pdserve.planner.service import PlannerService

    if not args.etcd:
        raise ValueError("--etcd is required (or set PDSERVE_ETCD)")
    profile, config = load_planner(args)
    auth = etcd_auth(args)
    names = {}
    for item in args.deployment:
        model, sep, name = item.partition("=")
        if not sep or not model or not name:
            raise ValueError(f"--deployment expects MODEL=NAME, got {item!r}")
        names[model] = name
    connectors: dict[str, ScalingConnector] = {}

    def connector_for(model: str) -> ScalingConnector | None:
        if model not in connectors:
            if args.connector == "kubernetes":
                connectors[model] = KubernetesConnector(names.get(model, kubernetes_name(model)), args.namespace)
            else:
                connectors[model] = AdviseOnly()
        return connectors[model]

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        print(
            f"pdserve planner: planning every {config.interval_s:g}s from {args.etcd} (connector: {args.connector})",
            flush=True,
        )
        service = PlannerService(args.etcd, profile, connector_for, config, auth)
        if args.metrics_port >= 0:
            serve_metrics(service.metrics.registry, "0.0.0.0", args.metrics_port)
        await service.run(stop)

    asyncio.run(main())
    return 0
