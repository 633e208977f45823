"""A CPU LLMDeployment of the builtin engine through its life on a real cluster, with the
control plane the Helm chart installed: Ready, answered through the router, `kubectl scale`
to two replicas, load that makes the autoscaler add a replica, and its children gone once it
is deleted. Runs only when KUBECONFIG is set (scripts/kind-e2e.sh)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import yaml
from e2e_cluster import KEY, condition, get_json, kubectl, needs_cluster, router_url, wait_for

pytestmark = needs_cluster

NAME = "e2e-cpu"
MODEL = "smollm2-135m"
CHILD_KINDS = ("deployment", "service", "configmap", "poddisruptionbudget")


def _llmdeployment(namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "fleetllm.io/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": NAME, "namespace": namespace},
        "spec": {
            "model": {"name": MODEL, "source": "builtin://smollm2-135m"},
            "gpu": {"type": "cpu"},
            "maxModelLen": 2048,
            "replicas": 1,
            "pod": {"resources": {"requests": {"cpu": "500m"}, "limits": {"memory": "3Gi"}}},
        },
    }


def _llmd(namespace: str) -> dict[str, Any]:
    return get_json("llmdeployment", NAME, "-n", namespace)


def _ready_replicas(namespace: str, wanted: int) -> dict[str, Any] | None:
    obj = _llmd(namespace)
    ready = condition(obj, "Ready")
    status = obj.get("status", {})
    if ready and ready["status"] == "True" and status.get("readyReplicas") == wanted:
        return obj
    return None


def _children(namespace: str) -> dict[str, list[Any]]:
    selector = f"app.kubernetes.io/instance={NAME}"
    return {kind: get_json(kind, "-n", namespace, "-l", selector)["items"] for kind in CHILD_KINDS}


async def _ask(client: httpx.AsyncClient, url: str, model: str, max_tokens: int) -> int:
    answer = await client.post(
        f"{url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={
            "model": model,
            "messages": [{"role": "user", "content": "Tell me a long story about the sea."}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
        },
    )
    assert answer.status_code == 200, answer.text
    return int(answer.json()["usage"]["completion_tokens"])


def test_ready_answered_scaled_autoscaled_and_deleted(namespace: str) -> None:
    kubectl("apply", "-f", "-", stdin=yaml.safe_dump(_llmdeployment(namespace)))
    wait_for(lambda: _ready_replicas(namespace, 1), "Ready with one replica", 600)
    # The quickstart serves the same model in `default`: ids here are NAMESPACE/MODEL.
    model = f"{namespace}/{MODEL}"

    with router_url() as url:

        async def one_answer() -> int:
            async with httpx.AsyncClient(timeout=300) as client:
                return await _ask(client, url, model, 8)

        assert asyncio.run(one_answer()) == 8

        # kubectl scale goes through the scale subresource; the operator follows.
        kubectl("scale", "-n", namespace, f"llmdeployment/{NAME}", "--replicas=2")
        wait_for(lambda: _ready_replicas(namespace, 2), "two ready replicas", 600)
        engine = get_json("deployment", f"{NAME}-engine", "-n", namespace)
        assert engine["spec"]["replicas"] == 2
        kubectl("scale", "-n", namespace, f"llmdeployment/{NAME}", "--replicas=1")
        wait_for(lambda: _ready_replicas(namespace, 1), "back to one replica", 600)

        # With scaling bounds and a tight queue-time target, load makes the autoscaler add a
        # replica: more concurrent long requests than one replica's sequence slots.
        scaling = {"minReplicas": 1, "maxReplicas": 2, "targetQueueTimeSeconds": 0.2}
        kubectl(
            "patch", "-n", namespace, f"llmdeployment/{NAME}", "--type=merge",
            "-p", yaml.safe_dump({"spec": {"scaling": scaling}}),
        )  # fmt: skip

        async def load_until_scaled() -> None:
            async with httpx.AsyncClient(timeout=600) as client:
                load = [asyncio.create_task(_ask(client, url, model, 256)) for _ in range(32)]
                try:
                    deadline = asyncio.get_running_loop().time() + 600
                    while _llmd(namespace)["spec"].get("replicas") != 2:
                        assert asyncio.get_running_loop().time() < deadline, "never scaled up"
                        await asyncio.sleep(3)
                finally:
                    await asyncio.gather(*load, return_exceptions=True)

        asyncio.run(load_until_scaled())
        scaled = _llmd(namespace)
        assert scaled["status"].get("desiredReplicas") == 2
        events = get_json(
            "events", "-n", namespace, "--field-selector", f"involvedObject.name={NAME}"
        )["items"]
        assert any(e.get("source", {}).get("component") == "fleetllm-operator" for e in events)

    # Deleting the LLMDeployment deletes its children (ownerReferences).
    assert all(_children(namespace).values())
    kubectl("delete", "-n", namespace, f"llmdeployment/{NAME}", "--wait=true")
    wait_for(lambda: not any(_children(namespace).values()), "the children gone", 300)
