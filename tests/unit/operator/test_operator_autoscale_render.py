"""spec.scaling.mode hpa | keda: the operator renders an autoscaling/v2 HPA or a KEDA
ScaledObject in place of its own autoscaler, valid for Kubernetes and for KEDA's schema."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubeschemas
import pytest
import yaml
from openapi_schema_validator import OAS30Validator

from fleetllm.api.manifests import parse_llmdeployment
from fleetllm.operator.render import render, render_autoscaler
from fleetllm.planner.plan import plan

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "manifests" / "examples" / "llama-3.1-8b-l4-awq.yaml"
KEDA_SCHEMA = ROOT / "tests" / "data" / "keda" / "scaledobject-v1alpha1-schema.yaml"
KUBERNETES_VERSIONS = ("1.30", "1.37")


def _strict(schema: Any) -> Any:
    """Unknown fields are errors (as with kubectl's strict field validation)."""
    if isinstance(schema, dict):
        schema = {key: _strict(value) for key, value in schema.items()}
        if schema.get("type") == "object" and "properties" in schema:
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [_strict(item) for item in schema]
    return schema


KEDA = OAS30Validator(_strict(yaml.safe_load(KEDA_SCHEMA.read_text())))


def keda_errors(obj: dict[str, Any]) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in KEDA.iter_errors(obj)]


def deployment(**scaling: Any) -> Any:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"].update(namespace="models", uid="0b2d6d5e-1b0a-4c1e-9d7b-3f5f1e0c0a11")
    doc["spec"]["scaling"] = {"minReplicas": 1, "maxReplicas": 6, **scaling}
    return parse_llmdeployment(doc)


def test_builtin_mode_renders_no_autoscaler() -> None:
    cr = deployment()
    assert cr.spec.scaling is not None and cr.spec.scaling.mode == "builtin"
    assert render_autoscaler(cr) is None
    assert [o["kind"] for o in render(cr, plan(cr.spec))][-1] == "NetworkPolicy"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_hpa_mode(version: str) -> None:
    cr = deployment(mode="hpa", targetKVCacheUsage=0.75, scaleDownDelaySeconds=3600)
    objects = render(cr, plan(cr.spec))
    hpa = objects[-1]
    assert hpa["kind"] == "HorizontalPodAutoscaler"
    kubeschemas.validate(hpa, version)
    spec = hpa["spec"]
    # It scales the LLMDeployment through its scale subresource, not the Deployment.
    assert spec["scaleTargetRef"] == {
        "apiVersion": "fleetllm.io/v1alpha1",
        "kind": "LLMDeployment",
        "name": "llama-8b-l4",
    }
    assert (spec["minReplicas"], spec["maxReplicas"]) == (1, 6)
    (metric,) = spec["metrics"]
    assert metric["pods"]["metric"]["name"] == "vllm:kv_cache_usage_perc"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "750m"}
    # The HPA's longest window (a longer delay is refused for this mode).
    assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 3600
    assert hpa["metadata"]["ownerReferences"][0]["kind"] == "LLMDeployment"
    assert hpa["metadata"]["labels"]["fleetllm.io/model"] == "llama-3.1-8b-instruct"


def test_keda_mode() -> None:
    cr = deployment(
        mode="keda",
        prometheusAddress="http://prometheus.monitoring.svc:9090",
        targetQueueTimeSeconds=0.5,
        scaleDownDelaySeconds=120,
    )
    so = render(cr, plan(cr.spec))[-1]
    assert so["kind"] == "ScaledObject" and so["apiVersion"] == "keda.sh/v1alpha1"
    assert keda_errors(so) == []
    spec = so["spec"]
    assert spec["scaleTargetRef"]["kind"] == "LLMDeployment"
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 6)
    assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"] == {
        "stabilizationWindowSeconds": 120
    }
    kv, queue = spec["triggers"]
    selector = 'namespace="models",model_name="llama-3.1-8b-instruct"'
    assert kv["metricType"] == "AverageValue"
    assert kv["metadata"] == {
        "serverAddress": "http://prometheus.monitoring.svc:9090",
        "query": f"sum(vllm:kv_cache_usage_perc{{{selector}}})",
        "threshold": "0.8",
    }
    assert queue["metricType"] == "Value"
    assert queue["metadata"]["query"] == (
        "histogram_quantile(0.9, sum by (le) "
        f"(rate(vllm:request_queue_time_seconds_bucket{{{selector}}}[1m])))"
    )
    assert queue["metadata"]["threshold"] == "0.5"


def test_keda_mode_from_zero_activates_on_the_routers_held_requests() -> None:
    cr = deployment(
        mode="keda",
        prometheusAddress="https://prom.monitoring.svc:9090/prefix",
        minReplicas=0,
        scaleToZeroAfterSeconds=900,
    )
    so = render_autoscaler(cr)
    assert so is not None and keda_errors(so) == []
    assert so["spec"]["minReplicaCount"] == 0 and so["spec"]["cooldownPeriod"] == 900
    demand = so["spec"]["triggers"][-1]
    assert demand["metadata"]["query"] == (
        'sum(fleetllm:router_held_requests{model="llama-3.1-8b-instruct"})'
    )
    assert demand["metadata"]["activationThreshold"] == "0"


def test_the_keda_schema_check_is_strict() -> None:
    so = render_autoscaler(deployment(mode="keda", prometheusAddress="http://p:9090"))
    assert so is not None
    bad = copy.deepcopy(so)
    bad["spec"]["minReplicas"] = 1  # the HPA's name, not KEDA's
    assert keda_errors(bad)
    bad = copy.deepcopy(so)
    bad["spec"]["triggers"][0]["metadata"]["threshold"] = 0.8  # must be a string
    assert keda_errors(bad)
    bad = copy.deepcopy(so)
    del bad["spec"]["scaleTargetRef"]
    assert keda_errors(bad)


@pytest.mark.parametrize(
    ("scaling", "message"),
    [
        ({"mode": "keda"}, "mode keda needs prometheusAddress"),
        ({"mode": "hpa", "minReplicas": 0}, "mode hpa needs minReplicas >= 1"),
        ({"mode": "vpa"}, "mode"),
        ({"mode": "keda", "prometheusAddress": "prometheus:9090"}, "prometheusAddress"),
        # KEDA queries it with its own identity: in-cluster Services only.
        ({"mode": "keda", "prometheusAddress": "http://169.254.169.254/x"}, "prometheusAddress"),
        ({"mode": "keda", "prometheusAddress": "http://10.0.0.1:9090"}, "prometheusAddress"),
        (
            {"mode": "keda", "prometheusAddress": "https://prom.attacker.example"},
            "prometheusAddress",
        ),
        # Two labels read as SERVICE.NAMESPACE, but the cluster's DNS falls through to the
        # internet's for a namespace that does not exist.
        ({"mode": "keda", "prometheusAddress": "https://attacker.example"}, "prometheusAddress"),
        ({"mode": "keda", "prometheusAddress": "http://prom.monitoring:9090"}, "prometheusAddress"),
        ({"mode": "keda", "prometheusAddress": "http://[fd00:ec2::254]/"}, "prometheusAddress"),
        # What the HPA (under KEDA too) cannot do as the builtin mode does is refused, not
        # done otherwise in silence.
        (
            {"mode": "keda", "prometheusAddress": "http://p:9090", "minReplicas": 0},
            "mode keda with minReplicas 0 needs scaleToZeroAfterSeconds",
        ),
        (
            {"mode": "hpa", "scaleDownDelaySeconds": 3601},
            "modes hpa and keda take scaleDownDelaySeconds up to 3600",
        ),
        (
            {"mode": "keda", "prometheusAddress": "http://p:9090", "scaleDownDelaySeconds": 7200},
            "use mode builtin for a longer delay",
        ),
        (
            {"mode": "hpa", "targetQueueTimeSeconds": 0.5},
            "mode hpa scales on KV-cache usage only",
        ),
    ],
)
def test_invalid_modes_are_refused(scaling: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        deployment(**scaling)


def test_what_only_the_builtin_mode_does_stays_accepted_there() -> None:
    cr = deployment(minReplicas=0, scaleDownDelaySeconds=7200, targetQueueTimeSeconds=0.5)
    assert cr.spec.scaling is not None and cr.spec.scaling.mode == "builtin"
    keda = deployment(
        mode="keda", prometheusAddress="http://p:9090", targetQueueTimeSeconds=0.5
    ).spec.scaling
    assert keda is not None and keda.target_queue_time_seconds == 0.5
