"""The fleet's root secret, from which the operator and the router derive each LLMDeployment's
engine key: the chart makes it once (kept on upgrade and uninstall), both pods read it from the
same Secret through env, an admin's own Secret replaces it; and the router's /metrics, served
without a key for the ServiceMonitor, stays off the Ingress and the HTTPRoute."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from helmchart import CHART, VALUE_SETS, by_kind, documents, one, render, run, tool, validate

from fleetllm.api.contract import ENGINE_KEY_ROOT_ENV


def _root_env(objects: list[dict[str, Any]], component: str) -> dict[str, Any]:
    (deployment,) = [
        d
        for d in by_kind(objects, "Deployment")
        if d["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    (env,) = [e for e in container.get("env", []) if e["name"] == ENGINE_KEY_ROOT_ENV]
    return env


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_operator_and_router_read_the_root_from_the_one_secret_the_chart_makes(
    value_set: str | None,
) -> None:
    objects = render(value_set)
    assert validate(objects) == []
    secret = one(objects, "Secret", "fleetllm-engine-keys")
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    root = base64.b64decode(secret["data"]["root"]).decode()
    assert len(root) == 48 and root.isalnum()
    ref = {"secretKeyRef": {"name": "fleetllm-engine-keys", "key": "root"}}
    for component in ("operator", "router"):
        assert _root_env(objects, component) == {"name": ENGINE_KEY_ROOT_ENV, "valueFrom": ref}
    # No cluster to look the live one up in: each `helm template` makes another root (so
    # Argo CD and Flux users create the Secret themselves: values.yaml says so).
    again = documents(run(tool("helm"), "template", "fleetllm", str(CHART)).stdout)
    assert one(again, "Secret", "fleetllm-engine-keys")["data"]["root"] != secret["data"]["root"]


def test_an_admins_own_secret_replaces_the_charts() -> None:
    objects = render(None, "engineKeys.create=false", "engineKeys.secretName=my-root")
    assert [s["metadata"]["name"] for s in by_kind(objects, "Secret")] == []
    for component in ("operator", "router"):
        assert _root_env(objects, component)["valueFrom"]["secretKeyRef"]["name"] == "my-root"


def _router_args(objects: list[dict[str, Any]]) -> list[str]:
    deployment = one(objects, "Deployment", "fleetllm-router")
    return list(deployment["spec"]["template"]["spec"]["containers"][0]["args"])


def test_metrics_are_public_only_for_the_service_monitor_and_never_routed_out() -> None:
    assert "--public-metrics" not in _router_args(render())
    assert "--public-metrics" in _router_args(render("monitoring-values.yaml"))
    # The Ingress's /v1 paths pass; the HTTPRoute narrows to /v1 only with public metrics.
    monitored = render("ingress-values.yaml", "monitoring.serviceMonitor.enabled=true")
    route = one(monitored, "HTTPRoute", "fleetllm-router")
    assert route["spec"]["rules"][0]["matches"] == [
        {"path": {"type": "PathPrefix", "value": "/v1"}}
    ]
    open_route = one(render("ingress-values.yaml"), "HTTPRoute", "fleetllm-router")
    assert open_route["spec"]["rules"][0]["matches"][0]["path"]["value"] == "/"


@pytest.mark.parametrize("path", ["/", "/metrics", "/metrics/"])
def test_an_ingress_path_that_would_route_public_metrics_is_refused(path: str) -> None:
    result = run(
        tool("helm"), "template", "x", str(CHART),
        "--set", "ingress.enabled=true,monitoring.serviceMonitor.enabled=true",
        "--set", f"ingress.hosts[0].host=a.example.com,ingress.hosts[0].paths[0].path={path}",
        "--set", "ingress.hosts[0].paths[0].pathType=Prefix",
        check=False,
    )  # fmt: skip
    assert result.returncode != 0
    assert "would route the router's /metrics" in result.stderr, result.stderr
