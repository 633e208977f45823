"""manifests/base and manifests/monitoring are the chart, rendered (scripts/generate.sh): what
`kubectl kustomize` builds from them validates like the chart and equals the chart's objects
with the default values (the CRDs and the namespace included; the engine keys' root left out)."""

from __future__ import annotations

from typing import Any

from helmchart import (
    CHART,
    NAMESPACE,
    RELEASE,
    ROOT,
    by_kind,
    documents,
    run,
    tool,
    validate,
)

MANIFESTS = ROOT / "manifests"
REGENERATE = "regenerate with scripts/generate.sh"


def _key(obj: dict[str, Any]) -> tuple[str, str, str, str]:
    meta = obj["metadata"]
    return (obj["apiVersion"], obj["kind"], meta.get("namespace", ""), meta["name"])


def _by_key(objects: list[dict[str, Any]]) -> dict[tuple[str, str, str, str], dict[str, Any]]:
    keyed = {_key(o): o for o in objects}
    assert len(keyed) == len(objects), "two objects of one kind and name"
    return keyed


def _kustomize(folder: str) -> list[dict[str, Any]]:
    return documents(run(tool("kubectl"), "kustomize", str(MANIFESTS / folder)).stdout)


def _helm(*args: str) -> list[dict[str, Any]]:
    return documents(
        run(tool("helm"), "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args).stdout
    )


def test_kustomize_base_validates_and_equals_the_charts_defaults() -> None:
    base = _kustomize("base")
    assert validate(base) == []
    (namespace,) = by_kind(base, "Namespace")
    assert namespace["metadata"]["name"] == NAMESPACE
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    # All but the engine keys' root, which each install makes for itself (docs/helm.md).
    chart = _by_key([*_helm("--include-crds", "--set", "engineKeys.create=false"), namespace])
    ours = _by_key(base)
    assert sorted(ours) == sorted(chart), REGENERATE
    for key, obj in chart.items():
        assert ours[key] == obj, f"{key} differs from the chart's; {REGENERATE}"
    assert {k[1] for k in ours} >= {
        "CustomResourceDefinition",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "ClusterKopfPeering",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
    }


def test_kustomize_monitoring_equals_the_charts_monitoring_objects() -> None:
    monitoring = _kustomize("monitoring")
    assert validate(monitoring) == []
    chart = _helm(
        "--set", "monitoring.serviceMonitor.enabled=true,monitoring.podMonitor.enabled=true",
        "--set", "monitoring.prometheusRule.enabled=true,monitoring.dashboard.enabled=true",
    )  # fmt: skip
    wanted = [
        o
        for o in chart
        if o["kind"] in {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
        or (o["kind"], o["metadata"]["name"]) == ("ConfigMap", "fleetllm-dashboard")
    ]
    assert len(wanted) == 4
    assert _by_key(monitoring) == _by_key(wanted), REGENERATE
