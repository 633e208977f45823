"""The operator the Helm chart installed, on a real cluster (kind, k3d, ...): runs only when
KUBECONFIG is set (scripts/kind-e2e.sh). Each test applies LLMDeployments in a fresh namespace
and checks what the operator wrote there: plans, children with their ownerReferences, a
deleted child coming back, a refused plan.
"""

from __future__ import annotations

import yaml
from e2e_cluster import ROOT, condition, get_json, kubectl, needs_cluster, wait_for

pytestmark = needs_cluster


def test_example_gets_a_plan_and_its_children(namespace: str) -> None:
    example = yaml.safe_load((ROOT / "manifests" / "examples" / "smollm2-cpu.yaml").read_text())
    name = example["metadata"]["name"]
    kubectl("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(example))

    def planned() -> dict | None:
        obj = get_json("llmdeployment", name, "-n", namespace)
        cond = condition(obj, "Planned")
        return obj if cond and cond["status"] == "True" else None

    obj = wait_for(planned, "Planned=True")
    assert obj["status"]["plan"]["maxConcurrentTokens"] > 0
    assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"]
    uid = obj["metadata"]["uid"]
    for kind in ("deployment", "service", "configmap", "poddisruptionbudget"):
        child = get_json(kind, "-n", namespace, "-l", f"app.kubernetes.io/instance={name}")
        assert child["items"], f"no {kind} for {name}"
        for item in child["items"]:
            owners = item["metadata"].get("ownerReferences", [])
            assert any(o["uid"] == uid for o in owners), f"{kind} lacks its ownerReference"

    # A deleted child comes back.
    kubectl("delete", "service", "-n", namespace, "-l", f"app.kubernetes.io/instance={name}")
    wait_for(
        lambda: get_json("service", "-n", namespace, "-l", f"app.kubernetes.io/instance={name}")[
            "items"
        ],
        "the Service to be recreated",
    )


def test_unplannable_deployment_is_refused_with_a_reason(namespace: str) -> None:
    doc = {
        "apiVersion": "fleetllm.io/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": "too-big"},
        "spec": {
            "model": {"name": "llama-70b", "source": "hf://meta-llama/Llama-3.1-70B-Instruct"},
            "gpu": {"type": "L4"},
            "maxModelLen": 8192,
        },
    }
    kubectl("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(doc))

    def refused() -> dict | None:
        cond = condition(get_json("llmdeployment", "too-big", "-n", namespace), "Planned")
        return cond if cond and cond["status"] == "False" else None

    cond = wait_for(refused, "Planned=False")
    assert cond["message"]
    children = get_json("deployment", "-n", namespace, "-l", "app.kubernetes.io/instance=too-big")
    assert children["items"] == []
