"""The Grafana dashboard under dashboards/ is a dashboard Grafana imports (Prometheus
datasource variable, every panel queried through it) that names exactly the metrics Graft
exports, each of them; whether a running server exports the same ones is checked in
tests/vllm/test_serve.py. docs/metrics.md lists every worker counter's exported name."""

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
                  "Verified nodes and draft forwards", "Bookkeeping", "guard modes",
                  "Errors, state-save failures"):
        assert topic in titles, topic
    exprs = " ".join(dashboard_queries())
    for labelled in ("sum by (source)(rate(vllm:graft_accepted_tokens_total",
                     "sum by (mode)(rate(vllm:graft_steps_total",
                     "sum by (stage)(rate(vllm:graft_drafting_stops_total"):
        assert labelled in exprs, labelled


def exported_graft_metrics() -> set[str]:
    """Every ``vllm:graft_*`` metric name Graft exports (counters as ``..._total``)."""
    from vllm_graft.vllm.metrics import GRAFT_GAUGES, GRAFT_METRICS

    return ({f"vllm:graft_{family}_total" for family in GRAFT_METRICS}
            | {f"vllm:graft_{name}" for name in GRAFT_GAUGES})


def test_dashboard_shows_every_graft_metric_and_no_other():
    graft = {n for n in dashboard_metric_names() if n.startswith("vllm:graft_")}
    assert graft == exported_graft_metrics(), (
        f"exported but not on the dashboard: {sorted(exported_graft_metrics() - graft)}; "
        f"on the dashboard but not exported: {sorted(graft - exported_graft_metrics())}")


def test_every_worker_counter_has_a_conventional_name_listed_in_the_docs():
    """Seconds, not microseconds; one family with a label where the worker has one name
    per value; docs/metrics.md gives each worker counter's old and new name."""
    from vllm_graft.vllm.metrics import GRAFT_COUNTERS, series_name

    rename = (DASHBOARD.parents[1] / "docs" / "metrics.md").read_text()
    for worker in (*GRAFT_COUNTERS, "stage_0", "stage_5"):
        new = series_name(worker)
        assert "_us" not in new and "milli" not in new, new
        assert f"| `vllm:graft_{worker}_total` | `{new}` |" in rename, worker
    assert series_name("accepted_context") == \
        'vllm:graft_accepted_tokens_total{source="context"}'
    assert series_name("guard_chain_steps") == 'vllm:graft_steps_total{mode="chain"}'
    assert series_name("stage_1") == 'vllm:graft_drafting_stops_total{stage="1"}'
    assert series_name("heap_trim_us") == "vllm:graft_heap_trim_seconds_total"


def test_exported_values_read_back_in_the_workers_names_and_units():
    """Counts go out in seconds and tokens under their families' labels, and Graft's
    offline reader turns them back into the worker's names and units."""
    from types import SimpleNamespace

    import prometheus_client
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    from vllm_graft.vllm.metrics import GraftPrometheus, read_graft_values

    counts = {"accepted_context": 3, "guard_chain_steps": 2, "stage_5": 4,
              "bookkeeping_us": 1_234_567, "auto_predicted_accepted_milli": 2_500}
    unregister_vllm_metrics()  # as vLLM's own logger does before it registers
    exporter = GraftPrometheus({0: ["m", "0"]})
    try:
        exporter.declare(["stage_0"])
        exporter.observe(SimpleNamespace(graft_stats=counts, graft_gauges=None), 0)
        text = prometheus_client.generate_latest().decode()
        for line in ('vllm:graft_accepted_tokens_total{engine="0",model_name="m",'
                     'source="context"} 3.0',
                     'vllm:graft_steps_total{engine="0",mode="chain",model_name="m"} 2.0',
                     'vllm:graft_drafting_stops_total{engine="0",model_name="m",stage="0"} 0.0',
                     'vllm:graft_bookkeeping_seconds_total{engine="0",model_name="m"} 1.234567',
                     'vllm:graft_auto_predicted_accepted_tokens_total{engine="0",'
                     'model_name="m"} 2.5'):
            assert line in text.splitlines(), line
        values = read_graft_values()
        assert {k: values[k] for k in counts} == counts
        assert values["stage_0"] == 0
    finally:
        unregister_vllm_metrics()
