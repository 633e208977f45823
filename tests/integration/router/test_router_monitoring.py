"""Every PromQL expression of the chart's alerts and Grafana dashboard (and of the metrics
reference's queries) refers only to metrics a live engine and a live router export, and
selects and groups by labels those series carry (or that Prometheus adds to every scraped
series); docs/metrics.md documents exactly the metrics they export."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
from helmchart import ROOT, groupings, promql_expressions, render, selectors
from prometheus_client.parser import text_string_to_metric_families
from router_testkit import EngineFleet, serve_router

from fleetllm.router.config import RouterSettings
from fleetllm.router.discovery import ModelRoute, Publish, ReplicaRef

pytestmark = pytest.mark.asyncio

# Labels Prometheus gives every series it scrapes through a ServiceMonitor or PodMonitor.
TARGET_LABELS = {"namespace", "pod", "container", "service", "endpoint", "job", "instance"}
# Exported only by engines started with a flag the test fleet's engines do not take; their
# rows must say so.
ONLY_WITH_A_FLAG = {"vllm:lora_requests_info": "--enable-lora"}
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
}


class TwoModels:
    """Discovery that reports a model on one replica and one scaled to zero, with the replica
    counts Kubernetes discovery takes from their LLMDeployments."""

    def __init__(self, *routes: ModelRoute) -> None:
        self.routes = {route.name: route for route in routes}
        self.demand: list[str] = []

    async def run(self, publish: Publish) -> None:
        publish(self.routes)
        await asyncio.Event().wait()

    async def signal_demand(self, route: ModelRoute) -> None:
        self.demand.append(route.name)


def _families(*texts: str) -> set[str]:
    """The metric names as documented (counters with their `_total`; not the `_created`
    timestamps prometheus_client adds as families of their own)."""
    return {
        family.name + ("_total" if family.type == "counter" else "")
        for text in texts
        for family in text_string_to_metric_families(text)
        if not family.name.endswith("_created")
    }


def _exported(*texts: str) -> dict[str, set[str]]:
    """Sample name -> label names seen, for every family the texts declare."""
    names: dict[str, set[str]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            for suffix in SUFFIXES.get(family.type, ("",)):
                names.setdefault(family.name + suffix, set())
            for sample in family.samples:
                names.setdefault(sample.name, set()).update(sample.labels)
    return names


async def test_alerts_and_dashboard_use_only_what_the_engine_and_router_export(
    engines: EngineFleet,
) -> None:
    engine = engines.beta
    discovery = TwoModels(
        ModelRoute("beta", (ReplicaRef(engine.url),), desired_replicas=1, max_replicas=3),
        ModelRoute("cold", (), desired_replicas=0, max_replicas=2),
    )
    async with (
        serve_router(RouterSettings(hold_timeout=0.5), discovery) as (_, url),
        httpx.AsyncClient(timeout=60) as client,
    ):
        answers = await asyncio.gather(
            *(
                client.post(
                    f"{url}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 3}
                )
                for model in ("beta", "cold")
            )
        )
        # beta answers; cold's request is held for a replica, asked for, and refused in time.
        assert [a.status_code for a in answers] == [200, 503], [a.text for a in answers]
        assert discovery.demand == ["cold"]
        router_text = (await client.get(f"{url}/metrics")).text
        engine_text = (await client.get(f"{engine.url}/metrics")).text

    exported = _exported(engine_text, router_text)
    # The series the dashboard's replica panel and the at-max alert read are live.
    assert 'fleetllm:router_model_max_replicas{model="beta"} 3.0' in router_text
    assert 'fleetllm:router_model_desired_replicas{model="beta"} 1.0' in router_text

    # docs/metrics.md lists exactly what is exported, and its queries use only that.
    metrics_page = (ROOT / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `((?:vllm|fleetllm):\w+)`", metrics_page, re.M))
    assert documented == _families(engine_text, router_text) | set(ONLY_WITH_A_FLAG)
    for name, flag in ONLY_WITH_A_FLAG.items():
        (row,) = (line for line in metrics_page.splitlines() if line.startswith(f"| `{name}`"))
        assert f"with `{flag}`" in row, row
    queries = re.findall(r"^\| [^|]+ \| `(.+)` \|$", metrics_page, re.M)
    assert len(queries) >= 5

    expressions = promql_expressions(render("monitoring-values.yaml"))
    expressions += [(f"docs/metrics.md: {q}", q) for q in queries]
    used: set[str] = set()
    for where, expression in expressions:
        for name, labels in selectors(expression):
            assert name in exported, f"{where}: {name} is exported by neither engine nor router"
            assert labels <= exported[name] | TARGET_LABELS, (where, name, labels)
            used.add(name)
        for labels, metrics in groupings(expression):
            carried = set().union(*(exported[m] for m in metrics)) | TARGET_LABELS
            assert labels <= carried, (where, labels, metrics)
    assert any(name.startswith("vllm:") for name in used)
    assert any(name.startswith("fleetllm:router_") for name in used)
