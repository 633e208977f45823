"""The operator (kopf) against an emulated API server: the reconcile loop end to end."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from kubeapi import KMOCK_WARNINGS
from operator_testkit import CR, CRS, DEPLOYMENTS, merge_patch, smollm2_cr

from fleetllm.api.deployment import KIND

pytestmark = [pytest.mark.asyncio, KMOCK_WARNINGS]

SERVICES = "v1/services"
CONFIGMAPS = "v1/configmaps"
PDBS = "policy/v1/poddisruptionbudgets"

SMOLLM2 = smollm2_cr(replicas=2)


def _condition(cr: dict[str, Any] | None, ctype: str) -> dict[str, Any] | None:
    for cond in ((cr or {}).get("status") or {}).get("conditions", []):
        if cond["type"] == ctype:
            return cond
    return None


def _children(api: Any, name: str = "smol") -> dict[str, dict[str, Any] | None]:
    return {
        "Deployment": api.get(DEPLOYMENTS, f"{name}-engine"),
        "Service": api.get(SERVICES, name),
        "ConfigMap": api.get(CONFIGMAPS, f"{name}-engine"),
        "PodDisruptionBudget": api.get(PDBS, f"{name}-engine"),
    }


def _events(api: Any, reason: str, text: str) -> list[dict[str, Any]]:
    return [
        e
        for e in api.list("v1/events")
        if e.get("reason") == reason
        and text in e.get("message", "")
        and e["involvedObject"]["kind"] == KIND
    ]


def _arg(deployment: dict[str, Any], flag: str) -> str:
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return args[args.index(flag) + 1]


async def _create(api: Any, body: dict[str, Any]) -> None:
    async with api.post(CRS, json=body) as response:
        assert response.status in (200, 201), await response.text()


async def _settled(api: Any, eventually: Any, name: str = "smol") -> dict[str, Any]:
    await eventually(lambda: all(_children(api, name).values()), "all children exist")
    return await eventually(
        lambda: (
            (cr := api.get(CR, name))
            and (cr.get("status") or {}).get("observedGeneration") == cr["metadata"]["generation"]
            and cr
        ),
        "status observes the current generation",
    )


async def test_create_update_recreate_and_restart(
    api: Any, start_operator: Any, eventually: Any
) -> None:
    operator = await start_operator()
    await _create(api, SMOLLM2)
    cr = await _settled(api, eventually)
    uid = cr["metadata"]["uid"]
    # Nothing needs cleanup beyond garbage collection: no finalizer blocks deletion.
    assert not cr["metadata"].get("finalizers")

    # Children exist, owned by the LLMDeployment, labelled for the router.
    for kind, child in _children(api).items():
        assert child is not None, kind
        refs = child["metadata"]["ownerReferences"]
        assert [(r["kind"], r["name"], r["uid"], r["controller"]) for r in refs] == [
            (KIND, "smol", uid, True)
        ], kind
        assert child["metadata"]["labels"]["fleetllm.io/model"] == "smollm2-135m"
        assert child["metadata"]["labels"]["app.kubernetes.io/instance"] == "smol"
    deployment = api.get(DEPLOYMENTS, "smol-engine")
    assert deployment["spec"]["replicas"] == 2
    assert _arg(deployment, "--max-model-len") == "4096"
    service = api.get(SERVICES, "smol")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["ports"][0]["name"] == "http"

    # Status: the plan, conditions, the scale selector.
    status = cr["status"]
    assert status["plan"]["maxModelLen"] == 4096
    assert status["plan"]["maxConcurrentTokens"] >= 4096
    assert (
        status["plan"]["engineArgs"]
        == deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    assert _condition(cr, "Planned")["status"] == "True"
    assert _condition(cr, "Ready")["status"] == "False"
    assert _condition(cr, "Ready")["reason"] == "NoReplicaReady"
    assert status["desiredReplicas"] == 2
    assert "app.kubernetes.io/instance=smol" in status["selector"]

    # Status follows the Deployment: play the Deployment controller.
    dep_status = {
        "observedGeneration": deployment["metadata"]["generation"],
        "replicas": 2,
        "updatedReplicas": 2,
        "readyReplicas": 2,
        "availableReplicas": 2,
    }
    await merge_patch(
        api,
        "/apis/apps/v1/namespaces/default/deployments/smol-engine/status",
        {"status": dep_status},
    )
    cr = await eventually(
        lambda: (c := api.get(CR, "smol")) and c["status"].get("readyReplicas") == 2 and c,
        "readyReplicas follows the Deployment",
    )
    assert _condition(cr, "Ready")["status"] == "True"
    assert _condition(cr, "Progressing")["reason"] == "RolloutComplete"

    # Update maxModelLen: the Deployment's args change, observedGeneration advances, and only
    # the children whose rendering changed are written.
    generation = cr["metadata"]["generation"]
    writes_before = len(api.writes())
    service_rv = api.get(SERVICES, "smol")["metadata"]["resourceVersion"]
    await merge_patch(api, f"{CRS}/smol", {"spec": {"maxModelLen": 2048}})
    await eventually(
        lambda: _arg(api.get(DEPLOYMENTS, "smol-engine"), "--max-model-len") == "2048",
        "Deployment args follow maxModelLen",
    )
    cr = await eventually(
        lambda: (c := api.get(CR, "smol"))["status"]["observedGeneration"] == generation + 1 and c,
        "observedGeneration advances",
    )
    assert cr["status"]["plan"]["maxModelLen"] == 2048
    await eventually(
        lambda: (
            '"maxModelLen":2048'
            in api.get(CR, "smol")["metadata"]["annotations"].get(
                "fleetllm.io/last-handled-configuration", ""
            )
        ),
        "kopf records the handled spec",
    )
    assert api.get(SERVICES, "smol")["metadata"]["resourceVersion"] == service_rv
    child_writes = [
        (r.resource.plural, r.name)
        for r in api.writes()[writes_before:]
        if r.resource is not None and r.resource.plural not in ("llmdeployments", "events")
    ]
    assert sorted(child_writes) == [("configmaps", "smol-engine"), ("deployments", "smol-engine")]

    # A deleted child is recreated.
    async with api.delete("/api/v1/namespaces/default/services/smol") as response:
        assert response.status == 200
    recreated = await eventually(lambda: api.get(SERVICES, "smol"), "the Service is recreated")
    assert recreated["metadata"]["ownerReferences"][0]["uid"] == uid

    # Events report what was done; the recreation's is posted in the background.
    await eventually(
        lambda: len(_events(api, "Created", "Service smol")) == 2,
        "an Event for the recreated Service",
    )
    assert _events(api, "Updated", "Deployment smol-engine")
    assert _events(api, "Planned", "Planned is True")

    # Unchanged spec: a reconcile (here triggered by another controller touching the
    # Deployment) writes nothing.
    settled_count = operator.reconciles("smol")
    writes_before = len(api.writes())
    await merge_patch(
        api,
        "/apis/apps/v1/namespaces/default/deployments/smol-engine",
        {"metadata": {"annotations": {"other-controller/seen": "yes"}}},
    )
    await eventually(
        lambda: operator.reconciles("smol") > settled_count, "a reconcile after the touch"
    )
    new_writes = api.writes()[writes_before:]
    assert [(r.method, r.url.path) for r in new_writes] == [
        ("PATCH", "/apis/apps/v1/namespaces/default/deployments/smol-engine")  # the test's own
    ], [(r.method, r.url.path, r.data) for r in new_writes]

    # Operator restart: the resumed reconcile finds everything in place and writes nothing.
    await operator.stop()
    writes_before = len(api.writes())
    restarted = await start_operator()
    await eventually(lambda: restarted.handled_cycles("smol") >= 1, "the resumed handling")
    assert restarted.reconciles("smol") >= 1
    assert [(r.method, r.url.path, r.data) for r in api.writes()[writes_before:]] == []


async def test_unplannable_gets_planned_false_and_no_children(
    api: Any, start_operator: Any, eventually: Any
) -> None:
    await start_operator()
    body = copy.deepcopy(SMOLLM2)
    body["metadata"]["name"] = "too-big"
    body["spec"] = {
        "model": {"name": "llama-70b", "source": "hf://meta-llama/Llama-3.1-70B-Instruct"},
        "engine": {"backend": "vllm"},
        "gpu": {"type": "H100-80GB"},
        "parallelism": {"tensor": 2},
    }
    await _create(api, body)
    cr = await eventually(
        lambda: _condition(api.get(CR, "too-big"), "Planned") and api.get(CR, "too-big"),
        "the Planned condition",
    )
    planned = _condition(cr, "Planned")
    assert planned["status"] == "False"
    assert planned["reason"] == "KVCacheTooSmall"
    assert "parallelism.tensor: 4" in planned["message"]
    assert cr["status"]["observedGeneration"] == cr["metadata"]["generation"]
    assert "plan" not in cr["status"]
    assert all(child is None for child in _children(api, "too-big").values())
    child_writes = [
        r
        for r in api.writes()
        if r.resource is not None and r.resource.plural not in ("llmdeployments", "events")
    ]
    assert child_writes == []

    # Fixing the spec plans it and creates the children.
    await merge_patch(api, f"{CRS}/too-big", {"spec": {"parallelism": {"tensor": 4}}})
    await eventually(lambda: all(_children(api, "too-big").values()), "children after the fix")
    deployment = api.get(DEPLOYMENTS, "too-big-engine")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert _arg(deployment, "--tensor-parallel-size") == "4"
    cr = await eventually(
        lambda: (
            (c := api.get(CR, "too-big")) and _condition(c, "Planned")["status"] == "True" and c
        ),
        "Planned=True",
    )
    assert cr["status"]["plan"]["gpuCount"] == 4


async def test_a_claim_two_replicas_cannot_share_is_refused_with_the_reason(
    api: Any, start_operator: Any, eventually: Any
) -> None:
    """The reconciler reads the pvc:// source's claim: ReadWriteOnce attaches to one node, so
    two replicas spread over nodes could never both start."""
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "weights", "namespace": "default"},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": "20Gi"}},
        },
    }
    async with api.post(
        "/api/v1/namespaces/default/persistentvolumeclaims", json=claim
    ) as response:
        assert response.status in (200, 201), await response.text()
    await start_operator()
    body = copy.deepcopy(SMOLLM2)
    body["metadata"]["name"] = "on-claim"
    body["spec"]["model"] = {
        "name": "smollm2-135m",
        "source": "pvc://weights/smollm2",
        "architecture": "SmolLM2-135M",
    }
    await _create(api, body)
    cr = await eventually(
        lambda: _condition(api.get(CR, "on-claim"), "Planned") and api.get(CR, "on-claim"),
        "the Planned condition",
    )
    planned = _condition(cr, "Planned")
    assert (planned["status"], planned["reason"]) == ("False", "ClaimNotShareable")
    assert "weights is ReadWriteOnce" in planned["message"]
    assert all(child is None for child in _children(api, "on-claim").values())

    # One replica can use it.
    await merge_patch(api, f"{CRS}/on-claim", {"spec": {"replicas": 1}})
    await eventually(lambda: all(_children(api, "on-claim").values()), "children with 1 replica")
    deployment = api.get(DEPLOYMENTS, "on-claim-engine")
    assert _arg(deployment, "--model") == "/models/smollm2"


async def test_a_child_the_api_server_refuses_is_reported_in_the_status(
    api: Any, start_operator: Any, eventually: Any
) -> None:
    """pod.affinity is passed through as written: when the API server refuses the Deployment
    made from it (422), the status says so with the server's message, the rest is applied, and
    fixing the spec applies the Deployment."""
    await start_operator()
    body = copy.deepcopy(SMOLLM2)
    body["metadata"]["name"] = "bad-pod"
    body["spec"]["pod"] = {"affinity": {"podAntiAffinity": {"preferredSoon": []}}}
    await _create(api, body)
    cr = await eventually(
        lambda: (
            (c := api.get(CR, "bad-pod"))
            and (_condition(c, "Degraded") or {}).get("reason") == "Rejected"
            and c
        ),
        "Degraded: Rejected",
    )
    degraded = _condition(cr, "Degraded")
    assert degraded["status"] == "True"
    assert "Deployment bad-pod-engine" in degraded["message"]
    assert "preferredSoon" in degraded["message"]
    assert _condition(cr, "Progressing")["reason"] == "Rejected"
    assert _condition(cr, "Planned")["status"] == "True"
    children = _children(api, "bad-pod")
    assert children["Deployment"] is None
    assert children["Service"] is not None and children["ConfigMap"] is not None
    await eventually(lambda: _events(api, "Rejected", "preferredSoon"), "a Warning Event")

    await merge_patch(api, f"{CRS}/bad-pod", {"spec": {"pod": {"affinity": None}}})
    await eventually(lambda: api.get(DEPLOYMENTS, "bad-pod-engine"), "the Deployment after the fix")
    await eventually(
        lambda: _condition(api.get(CR, "bad-pod"), "Degraded")["status"] == "False",
        "Degraded=False after the fix",
    )
    # The refusals this test causes, and only those (any other invalid write fails the test).
    assert api.validation_errors
    assert all(
        e.startswith("Deployment bad-pod-engine:") and "preferredSoon" in e
        for e in api.validation_errors
    ), api.validation_errors
    api.validation_errors.clear()


async def test_builtin_parallel_int8_and_speculative_specs_are_refused_or_rendered(
    api: Any, start_operator: Any, eventually: Any
) -> None:
    """SmolLM2 on the builtin engine: tensor 2 does not split its 9 heads and 3 KV heads,
    speculative lookup bounds the wrong way round are an invalid spec (both Planned=False,
    no children); tensor 3 with int8 weights and KV and n-gram drafts becomes engine flags."""
    await start_operator()
    body = copy.deepcopy(SMOLLM2)
    body["metadata"]["name"] = "smol-tp"
    body["spec"]["parallelism"] = {"tensor": 2}
    await _create(api, body)

    async def planned_false(reason: str) -> dict[str, Any]:
        cond = await eventually(
            lambda: (
                (c := _condition(api.get(CR, "smol-tp"), "Planned")) and c["reason"] == reason and c
            ),
            f"Planned=False {reason}",
        )
        assert cond["status"] == "False"
        assert all(child is None for child in _children(api, "smol-tp").values())
        return cond

    cond = await planned_false("ParallelismMismatch")
    assert (
        "attention heads (9) and KV heads (3) are not divisible by tensor parallelism 2"
        in (cond["message"])
    )

    async def patch(spec: dict[str, Any]) -> None:
        await merge_patch(api, f"{CRS}/smol-tp", {"spec": spec})

    bad = {"numSpeculativeTokens": 4, "promptLookupMax": 2, "promptLookupMin": 5}
    await patch({"parallelism": {"tensor": 3}, "speculative": bad})
    cond = await planned_false("InvalidSpec")
    assert "speculative" in cond["message"]
    assert "promptLookupMin 5 exceeds promptLookupMax 2" in cond["message"]

    await patch(
        {
            "quantization": {"weights": "int8", "kvCache": "int8"},
            "speculative": {"promptLookupMin": 1},
        }
    )
    await eventually(lambda: all(_children(api, "smol-tp").values()), "children once valid")
    deployment = api.get(DEPLOYMENTS, "smol-tp-engine")
    assert _arg(deployment, "--tensor-parallel-size") == "3"
    assert _arg(deployment, "--quantization") == "int8"
    assert _arg(deployment, "--kv-cache-dtype") == "int8"
    assert json.loads(_arg(deployment, "--speculative-config")) == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 2,
        "prompt_lookup_min": 1,
    }
