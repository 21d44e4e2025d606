"""The Grafana dashboard under dashboards/ is a dashboard Grafana imports (Prometheus
datasource variable, every panel queried through it) and names only metrics that
exist; whether a running server exports them is checked in tests/vllm/test_serve.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "graft.json"
METRIC = re.compile(r"vllm:[a-z0-9_]+")


def dashboard_queries(dashboard: dict | None = None) -> list[str]:
    """Every PromQL expression: panel targets and templating queries."""
    dashboard = dashboard or json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            exprs.append(query["query"])
    return exprs


def dashboard_metric_names() -> set[str]:
    return {name for expr in dashboard_queries() for name in METRIC.findall(expr)}


def test_dashboard_is_grafana_json_over_prometheus():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 30
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert 'model_name="$model_name"' in target["expr"], panel["title"]
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]


def test_dashboard_covers_what_the_issue_asks_for():
    titles = " | ".join(p["title"] for p in json.loads(DASHBOARD.read_text())["panels"])
    for topic in ("MAT over time", "by source", "by depth", "Prune-stage", "hit rate",
                  "Verified nodes and draft forwards", "Bookkeeping"):
        assert topic in titles, topic


def test_dashboard_names_declared_graft_counters():
    """Graft counters the dashboard names are ones the worker counts (help texts exist),
    or the default checkpoints' prune stages."""
    from vllm_graft.vllm.metrics import GRAFT_COUNTERS

    known = {f"vllm:graft_{name}_total" for name in GRAFT_COUNTERS}
    known |= {f"vllm:graft_stage_{cp}_total" for cp in (0, 1, 5)}
    graft = {n for n in dashboard_metric_names() if n.startswith("vllm:graft_")}
    assert graft and graft <= known, graft - known
