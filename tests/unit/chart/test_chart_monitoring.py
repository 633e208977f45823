"""The chart's alerts and Grafana dashboard: the dashboard JSON parses, every PromQL expression
parses, the alerts and panels the runbook relies on are there, and every alert links a runbook
section that exists. (That the metric names are exported is checked against live engines and
a live router in tests/integration/router/test_router_monitoring.py.)"""

from __future__ import annotations

import json
import re

import pytest
from helmchart import (
    CHART,
    ROOT,
    by_kind,
    documents,
    groupings,
    one,
    promql_expressions,
    render,
    run,
    selectors,
    tool,
)

MONITORING = "monitoring-values.yaml"


def test_the_dashboard_parses_and_has_a_panel_per_quantity() -> None:
    dashboard = json.loads((CHART / "files" / "dashboard.json").read_text())
    titles = {panel["title"] for panel in dashboard["panels"]}
    assert titles >= {
        "Request rate",
        "Time to first token",
        "Inter-token latency",
        "End-to-end latency",
        "KV-cache usage",
        "Requests waiting and running",
        "Queue time",
        "Preemptions",
        "Prefix-cache hit ratio",
        "Replicas: desired and ready",
    }
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    (model,) = [v for v in dashboard["templating"]["list"] if v["name"] == "model"]
    assert model["multi"] and model["includeAll"]
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            # Per model: every query is filtered by the model variable.
            assert "$model" in target["expr"], (panel["title"], target["expr"])


def test_every_promql_expression_parses() -> None:
    expressions = promql_expressions(render(MONITORING))
    assert len(expressions) > 20
    for where, expression in expressions:
        assert selectors(expression), where
    with pytest.raises(ValueError):
        selectors("sum(rate(vllm:num_preemptions_total[5m])")


def test_the_alerts_are_there_and_link_their_runbook_sections() -> None:
    rule = one(render(MONITORING), "PrometheusRule", "fleetllm")
    alerts = {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}
    expected = {
        "FleetllmKVCacheFull": ("vllm:kv_cache_usage_perc", "5m"),
        "FleetllmPreemptionsRising": ("vllm:num_preemptions_total", "10m"),
        "FleetllmQueueTimeHigh": ("vllm:request_queue_time_seconds_bucket", "10m"),
        "FleetllmReplicasAtMax": ("fleetllm:router_model_max_replicas", "10m"),
        "FleetllmEngineReplicaDown": ("fleetllm:router_replica_up", "5m"),
        "FleetllmRouter5xx": ("fleetllm:router_requests_total", "5m"),
    }
    assert set(alerts) == set(expected)
    runbook = (ROOT / "docs" / "runbook.md").read_text()
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", heading.lower()).strip().replace(" ", "-")
        for heading in re.findall(r"^#+ (.+)$", runbook, re.M)
    }
    for name, (metric, duration) in expected.items():
        alert = alerts[name]
        assert metric in {m for m, _ in selectors(alert["expr"])}, name
        assert alert["for"] == duration, name
        assert alert["labels"]["severity"] in {"warning", "critical"}
        url = alert["annotations"]["runbook_url"]
        assert url.startswith("https://fleetllm.github.io/fleetllm/runbook/#")
        assert url.split("#", 1)[1] in anchors, f"{name}: docs/runbook.md lacks {url}"
    assert "> 0.95" in alerts["FleetllmKVCacheFull"]["expr"]


def test_alert_thresholds_are_values() -> None:
    # --set-json: helm's --set passes 0.9 as a string, which the schema refuses.
    objects = documents(
        run(
            tool("helm"), "template", "fleetllm", str(CHART), "-f", str(CHART / "ci" / MONITORING),
            "--set-json", "monitoring.prometheusRule.kvCacheUsage=0.9",
            "--set-json", "monitoring.prometheusRule.queueTimeP90Seconds=2.5",
        ).stdout
    )  # fmt: skip
    (rule,) = by_kind(objects, "PrometheusRule")
    exprs = {r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert exprs["FleetllmKVCacheFull"].endswith("> 0.9")
    assert exprs["FleetllmQueueTimeHigh"].endswith("> 2.5")


def test_groupings_name_labels() -> None:
    for where, expression in promql_expressions(render(MONITORING)):
        for labels, metrics in groupings(expression):
            assert labels and metrics, where
