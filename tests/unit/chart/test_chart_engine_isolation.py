"""The NetworkPolicy the operator renders for each LLMDeployment, with the operator flags and
policy the chart gives it: it lets in the chart's router and operator pods alone (their labels
in the release's namespace), cluster-wide as namespaced, selects the engine pods and their port,
and keeps them off cloud metadata."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helmchart import NAMESPACE, by_kind, one, render

from fleetllm.api.manifests import parse_llmdeployment
from fleetllm.cli import build_parser
from fleetllm.operator.cli import config_from_args
from fleetllm.operator.render import render as render_children
from fleetllm.planner.plan import plan


def _pod_labels(objects: list[dict[str, Any]], name: str) -> dict[str, str]:
    return one(objects, "Deployment", name)["spec"]["template"]["metadata"]["labels"]


@pytest.mark.parametrize("value_set", [None, "namespaced-values.yaml"])
def test_each_models_networkpolicy_admits_the_charts_router_and_operator_only(
    value_set: str | None, tmp_path: Path
) -> None:
    chart = render(value_set)
    (container,) = one(chart, "Deployment", "fleetllm-operator")["spec"]["template"]["spec"][
        "containers"
    ]
    args = build_parser().parse_args([*container["command"][1:], *container["args"]])
    (policy,) = [
        c for c in by_kind(chart, "ConfigMap") if c["metadata"]["name"].endswith("-policy")
    ]
    args.policy = tmp_path / "policy.yaml"  # the ConfigMap the operator mounts there
    args.policy.write_text(policy["data"]["policy.yaml"])
    config = config_from_args(args)

    cr = parse_llmdeployment(
        {
            "apiVersion": "fleetllm.io/v1alpha1",
            "kind": "LLMDeployment",
            "metadata": {"name": "chat", "namespace": "team-a", "uid": "u-1"},
            "spec": {
                "model": {"name": "smollm2-135m", "source": "builtin://smollm2-135m"},
                "gpu": {"type": "cpu"},
                "maxModelLen": 2048,
            },
        }
    )
    children = render_children(cr, plan(cr.spec, config), config)
    (netpol,) = by_kind(children, "NetworkPolicy")
    (engine,) = by_kind(children, "Deployment")
    spec = netpol["spec"]
    engine_pod = engine["spec"]["template"]
    assert spec["podSelector"]["matchLabels"].items() <= engine_pod["metadata"]["labels"].items()
    assert netpol["metadata"]["namespace"] == "team-a"

    (rule,) = spec["ingress"]
    (port,) = rule["ports"]
    assert port["port"] in [p["name"] for p in engine_pod["spec"]["containers"][0]["ports"]]
    # The chart's router and operator pods, in the release's namespace, and nothing else.
    router, operator = rule["from"]
    for peer, name in ((router, "fleetllm-router"), (operator, "fleetllm-operator")):
        assert peer["namespaceSelector"] == {
            "matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}
        }
        labels = _pod_labels(chart, name)
        assert peer["podSelector"]["matchLabels"].items() <= labels.items()
        others = [d for d in by_kind(chart, "Deployment") if d["metadata"]["name"] != name]
        assert not any(
            peer["podSelector"]["matchLabels"].items()
            <= d["spec"]["template"]["metadata"]["labels"].items()
            for d in others
        )
    # Egress anywhere but cloud metadata.
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    blocks = [peer["ipBlock"] for egress in spec["egress"] for peer in egress["to"]]
    assert {"cidr": "0.0.0.0/0", "except": ["169.254.169.254/32"]} in blocks
    assert all(block["except"] for block in blocks)
