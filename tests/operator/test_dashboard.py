"""The chart's Grafana dashboard: its ConfigMap renders only when ``dashboards.enabled``, with
the sidecar's label, and every PromQL expression in it names only metrics pdserve exports, the
set read from pdserve's own registries (every collector of every process)."""

from __future__ import annotations

import json
import re
import subprocess
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from pdserve.observability.metrics import FrontendMetrics, SupervisorMetrics, WorkerMetrics
from pdserve.observability.planner_metrics import PlannerMetrics
from pdserve.operator.metrics import OperatorMetrics
from pdserve.types.engine_load import EngineLoad
from tests.operator.conftest import CHART
from tests.utils.kube_server import k8s_binary

DASHBOARD = CHART / "dashboards" / "pdserve.json"

# The series names prometheus_client writes for each family type.
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "unknown": ("",),
}
PROMQL_FUNCTIONS = set(
    """abs absent absent_over_time avg avg_over_time bottomk ceil changes clamp clamp_max clamp_min count
    count_over_time count_values day_of_month day_of_week day_of_year days_in_month delta deriv exp floor group
    histogram_quantile holt_winters hour idelta increase irate label_join label_replace last_over_time ln log10 log2
    max max_over_time min min_over_time minute month predict_linear present_over_time quantile quantile_over_time rate
    resets round scalar sgn sort sort_desc sqrt stddev stddev_over_time stdvar stdvar_over_time sum sum_over_time time
    timestamp topk vector year""".split()
)
PROMQL_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "atan2", "group_left", "group_right"}


def exported_metrics() -> set[str]:
    """Every series name pdserve's processes can export, from the real collectors."""
    registries: list[CollectorRegistry] = [
        WorkerMetrics("decode", "w", "m", EngineLoad).registry,
        FrontendMetrics(lambda: 0).registry,
        SupervisorMetrics().registry,
        OperatorMetrics().registry,
        PlannerMetrics().registry,
    ]
    names = set()
    for registry in registries:
        for family in registry.collect():
            names |= {family.name + suffix for suffix in SUFFIXES[family.type]}
    # Only where NVML finds a GPU (absent on this machine): the names _GpuCollector writes.
    names |= {"pdserve_gpu_utilization", "pdserve_gpu_memory_used_bytes", "pdserve_gpu_memory_total_bytes"}
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers left once strings, template
    variables, label matchers, ranges, grouping clauses, numbers, functions and keywords are gone."""
    expr = re.sub(r'"(\\.|[^"\\])*"|\'(\\.|[^\'\\])*\'|`[^`]*`', " ", expr)
    expr = re.sub(r"\$\{[^}]*\}|\$\w+", " ", expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"(?<![\w:.])\d[\d.]*(?:[eE][+-]?\d+)?(?:ms|[smhdwy])?\b", " ", expr)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][\w:]*", expr):
        word = match.group()
        if expr[match.end() :].lstrip().startswith("("):
            assert word in PROMQL_FUNCTIONS, f"{word!r} is not a PromQL function"
        elif word.lower() not in PROMQL_KEYWORDS:
            names.add(word)
    return names


def expressions(dashboard: dict[str, Any]) -> list[str]:
    """Every panel target's ``expr`` (rows' panels included) and every query variable's query."""
    exprs = []
    panels = list(dashboard["panels"])
    while panels:
        panel = panels.pop()
        panels += panel.get("panels", [])
        exprs += [target["expr"] for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", query)
            exprs.append(inner.group(1) if inner else query)
    return exprs


def test_every_promql_expression_names_only_metrics_pdserve_exports() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_metrics()
    named: set[str] = set()
    for expr in expressions(dashboard):
        unknown = metric_names(expr) - exported
        assert not unknown, f"{expr}\n  names metrics pdserve does not export: {sorted(unknown)}"
        named |= metric_names(expr)
    # The panels: latency against the SLO, goodput, queues, KV pool, pulls, migrations, planner.
    assert {
        "pdserve_ttft_seconds_bucket",
        "pdserve_itl_seconds_bucket",
        "pdserve_slo_ttft_p90_seconds",
        "pdserve_slo_itl_p90_seconds",
        "pdserve_requests_total",
        "pdserve_queue_length",
        "pdserve_waiting_requests",
        "pdserve_kv_blocks_used",
        "pdserve_kv_transfer_bytes_total",
        "pdserve_kv_transfer_seconds_bucket",
        "pdserve_migrations_total",
        "pdserve_planner_replicas",
        "pdserve_planner_decisions_total",
    } <= named


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        (
            'histogram_quantile(0.9, sum by (le, model) (rate(pdserve_ttft_seconds_bucket{model=~"$model"}[5m])))',
            {"pdserve_ttft_seconds_bucket"},
        ),
        ("sum(rate(pdserve_kv_transfer_bytes_total[$__rate_interval])) / 1e9", {"pdserve_kv_transfer_bytes_total"}),
        ("pdserve_kv_blocks_used / on (worker) group_left pdserve_kv_blocks_free offset 5m", None),
        ("max(pdserve_made_up_seconds) by (model) > bool 0.5", {"pdserve_made_up_seconds"}),
    ],
)
def test_the_check_finds_the_metric_names_and_refuses_an_unknown_one(expr: str, names: set[str] | None) -> None:
    found = metric_names(expr)
    assert found == (names or {"pdserve_kv_blocks_used", "pdserve_kv_blocks_free"})
    assert ("pdserve_made_up_seconds" in found) == bool(found - exported_metrics())


def render(*values: str) -> list[dict[str, Any]]:
    result = subprocess.run(
        [str(k8s_binary("helm")), "template", "rel", str(CHART), "--namespace", "pds", *values],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def dashboards(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == "ConfigMap" and "pdserve.json" in d.get("data", {})]


def test_the_dashboard_configmap_renders_only_when_enabled_with_the_sidecars_label() -> None:
    assert dashboards(render()) == []
    (enabled,) = dashboards(render("--set", "dashboards.enabled=true"))
    assert enabled["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert enabled["metadata"]["namespace"] == "pds"
    assert json.loads(enabled["data"]["pdserve.json"]) == json.loads(DASHBOARD.read_text())
    (own,) = dashboards(
        render(
            *("--set", "dashboards.enabled=true", "--set", "dashboards.label=dashboards"),
            *("--set-string", "dashboards.labelValue=pdserve", "--set", "dashboards.namespace=monitoring"),
            *("--set", "dashboards.annotations.grafana_folder=pdserve"),
        )
    )
    assert own["metadata"]["labels"]["dashboards"] == "pdserve" and "grafana_dashboard" not in own["metadata"]["labels"]
    assert own["metadata"]["namespace"] == "monitoring"
    assert own["metadata"]["annotations"] == {"grafana_folder": "pdserve"}
