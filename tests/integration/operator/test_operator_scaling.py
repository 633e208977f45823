"""The operator's autoscaler (kopf timer -> scraper -> control law -> scale subresource)
against the emulated API server, with the engines' /metrics served by the test: our engine's
own exposition code, with the load each test sets. The test plays the Deployment and
ReplicaSet controllers: pods follow the Deployment's replicas, are removed lowest
pod-deletion-cost first, and are Ready when the test says so."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml
from deployment_manifests import smollm2
from kubeapi import CR_RESOURCE, KMOCK_WARNINGS, NAMESPACE, EmulatedApiServer
from openapi_schema_validator import OAS30Validator
from operator_testkit import DEPLOYMENTS, MODEL, Load, merge_patch, status_writers

from fleetllm.api.deployment import API_VERSION, KIND
from fleetllm.kube.client import DEFAULT_FIELD_MANAGER, KubeClient
from fleetllm.kube.login import load_credentials
from fleetllm.operator.scaler import FIELD_MANAGER, POD_DELETION_COST
from fleetllm.router.discovery import KubernetesDiscovery, ModelRoute

pytestmark = [pytest.mark.asyncio, KMOCK_WARNINGS]

ROOT = Path(__file__).resolve().parents[3]
CRS = f"/apis/fleetllm.io/v1alpha1/namespaces/{NAMESPACE}/llmdeployments"
TICK = 0.2  # the autoscaler's interval in these tests
KEDA_SCHEMA = ROOT / "tests" / "data" / "keda" / "scaledobject-v1alpha1-schema.yaml"


def llmdeployment(name: str, replicas: int, scaling: dict[str, Any] | None) -> dict[str, Any]:
    cr = smollm2(name, served_name=MODEL, maxModelLen=4096, replicas=replicas)
    if scaling is not None:
        cr["spec"]["scaling"] = scaling
    return cr


async def _create(api: EmulatedApiServer, body: dict[str, Any]) -> None:
    async with api.post(CRS, json=body) as response:
        assert response.status in (200, 201), await response.text()


def _cr(api: EmulatedApiServer, name: str) -> dict[str, Any]:
    cr = api.get(CR_RESOURCE, name)
    assert cr is not None
    return cr


def _events(api: EmulatedApiServer, name: str, reason: str) -> list[dict[str, Any]]:
    return [
        e
        for e in api.list("v1/events")
        if e["involvedObject"].get("name") == name and e.get("reason") == reason
    ]


def _scale_writes(api: EmulatedApiServer, name: str) -> list[Any]:
    return [
        r
        for r in api.writes()
        if r.subresource == "scale" and r.name == name and r.method == kmock.method.PATCH
    ]


async def _set_mode(api: EmulatedApiServer, name: str, mode: str) -> None:
    await merge_patch(api, f"{CRS}/{name}", {"spec": {"scaling": {"mode": mode}}})


def _condition(cr: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next(c for c in cr["status"]["conditions"] if c["type"] == ctype)


# -- the tests -------------------------------------------------------------------------------


async def test_kv_usage_scales_up_then_down_after_the_delay_least_busy_first(
    api: EmulatedApiServer, start_operator: Any, controllers: Any, eventually: Any
) -> None:
    operator = await start_operator(autoscale_interval=TICK)
    scaling = {"minReplicas": 1, "maxReplicas": 4, "scaleDownDelaySeconds": 2}
    # Full KV caches, every sequence slot taken (the plan's maxNumSeqs is 8), requests waiting.
    cluster = controllers("chat", Load(kv=0.95, running=8, waiting=2))
    await _create(api, llmdeployment("chat", 1, scaling))

    cr = await eventually(
        lambda: (c := _cr(api, "chat"))["spec"]["replicas"] == 4 and c,
        "scaled up to maxReplicas",
    )
    # x2 a step at most: 1 -> 2 -> 4 (a write refused with 409, when the object changed since
    # it was read, is tried again at the next step).
    await eventually(
        lambda: [d.replicas for _, _, d in operator.state.scaler.decisions] == [2, 4],
        "the decisions written",
    )
    writes = _scale_writes(api, "chat")
    assert {r.data["spec"]["replicas"] for r in writes} == {2, 4}
    assert all(r.params.get("fieldManager") == FIELD_MANAGER for r in writes)
    assert all(r.data["metadata"]["resourceVersion"] for r in writes)
    cr = await eventually(
        lambda: (
            (c := _cr(api, "chat"))
            .get("status", {})
            .get("lastScaleReason", "")
            .startswith("2 -> 4")
            and c
        ),
        "the status records the last scale",
    )
    assert "KV cache 0.95 (target 0.80)" in cr["status"]["lastScaleReason"]
    assert cr["status"]["lastScaleTime"].endswith("Z")
    assert cr["status"]["lastScaleChange"] == "up"
    # The reconciler, which alone writes it, follows spec.replicas.
    await eventually(
        lambda: _cr(api, "chat")["status"].get("desiredReplicas") == 4, "desiredReplicas"
    )
    writers = status_writers(api)
    assert writers["desiredReplicas"] == writers["conditions"] == {DEFAULT_FIELD_MANAGER}
    assert writers["lastScaleReason"] == writers["lastScaleChange"] == {FIELD_MANAGER}
    ups = await eventually(lambda: len(e := _events(api, "chat", "ScaledUp")) == 2 and e, "Events")
    assert [e["message"].split(":")[0] for e in ups] == ["1 -> 2", "2 -> 4"]
    await eventually(lambda: len(cluster.engines) == 4, "four replicas run")
    # The Deployment follows the LLMDeployment.
    assert api.get(DEPLOYMENTS, "chat-engine")["spec"]["replicas"] == 4

    # The load falls; the replicas hold different numbers of requests. No scale-down before
    # the delay, then to one replica, the busiest one kept.
    by_load = dict(zip(sorted(cluster.engines), (3, 0, 1, 2), strict=True))
    dropped = time.monotonic()
    for pod, running in by_load.items():
        cluster.engines[pod].load = Load(kv=0.05, running=running)
    await eventually(lambda: _cr(api, "chat")["spec"]["replicas"] < 4, "scaled down", 30)
    assert time.monotonic() - dropped >= 2.0
    # Straight to one, or through two while requests still arrive about as fast as when one
    # replica was too few (the request rate is a minute's average).
    await eventually(lambda: _cr(api, "chat")["spec"]["replicas"] == 1, "down to one", 90)
    downs = await eventually(lambda: _events(api, "chat", "ScaledDown"), "ScaledDown Events")
    assert downs[0]["message"].startswith("4 -> ")
    assert "every recommendation of the last 2s was at most" in downs[0]["message"]
    costs = {
        p["metadata"]["name"]: p["metadata"]["annotations"][POD_DELETION_COST]
        for p in api.list("v1/pods")
        if p["metadata"]["name"] in by_load
    } | {name: str(by_load[name]) for name in cluster.removed if name in by_load}
    assert costs == {pod: str(n) for pod, n in by_load.items()}
    await eventually(lambda: len(cluster.engines) == 1, "three replicas removed")
    (kept,) = cluster.engines
    assert by_load[kept] == 3
    assert operator.state.scaler.decisions[-1][2].change == "down"


async def test_idle_scales_to_zero_and_the_routers_demand_brings_one_back(
    api: EmulatedApiServer, start_operator: Any, controllers: Any, eventually: Any, tmp_path: Path
) -> None:
    await start_operator(autoscale_interval=TICK)
    scaling = {
        "minReplicas": 0,
        "maxReplicas": 2,
        "scaleDownDelaySeconds": 1,
        "scaleToZeroAfterSeconds": 2,
    }
    cluster = controllers("idle", Load(), ready_after=0.0)
    await _create(api, llmdeployment("idle", 1, scaling))

    cr = await eventually(
        lambda: (c := _cr(api, "idle"))["spec"]["replicas"] == 0 and c, "scaled to zero"
    )
    # The autoscaler's Event (the reconciler adds one for the condition).
    (event,) = await eventually(
        lambda: [e for e in _events(api, "idle", "ScaledToZero") if e["message"][0].isdigit()],
        "the ScaledToZero Event",
    )
    assert event["message"].startswith("1 -> 0: no requests for ")
    assert _cr(api, "idle")["status"]["lastScaleChange"] == "to-zero"
    cr = await eventually(
        lambda: (
            (c := _cr(api, "idle")).get("status", {}).get("observedGeneration")
            == c["metadata"]["generation"]
            and _condition(c, "ScaledToZero")["status"] == "True"
            and "the autoscaler scaled 1 -> 0" in _condition(c, "ScaledToZero")["message"]
            and c
        ),
        "the ScaledToZero condition",
    )
    assert cr["status"]["desiredReplicas"] == 0
    await eventually(lambda: not cluster.engines, "no replica left")

    # A request arrives: the router holds it and scales the model from zero, as it does in a
    # cluster. The new replica takes longer to start than scaleToZeroAfterSeconds: the
    # autoscaler must not take it away meanwhile.
    cluster.ready_after = 3.0
    kubeconfig = tmp_path / "kubeconfig"
    router = KubeClient(
        lambda: load_credentials(kubeconfig=kubeconfig), user_agent="fleetllm-router"
    )
    try:
        discovery = KubernetesDiscovery(router, NAMESPACE)
        await discovery.signal_demand(
            ModelRoute(MODEL, owner=(NAMESPACE, "idle"), desired_replicas=0)
        )
    finally:
        await router.close()
    asked = time.monotonic()
    assert _cr(api, "idle")["spec"]["replicas"] == 1
    await eventually(lambda: len(cluster.engines) == 1, "a replica starts")
    writes_before = len(_scale_writes(api, "idle"))
    while time.monotonic() - asked < 3.5:
        assert _cr(api, "idle")["spec"]["replicas"] == 1, "the autoscaler fought the router"
        await asyncio.sleep(0.1)
    assert len(_scale_writes(api, "idle")) == writes_before
    # Once ready and idle for scaleToZeroAfterSeconds, back to zero.
    await eventually(lambda: _cr(api, "idle")["spec"]["replicas"] == 0, "scaled to zero again", 20)
    await eventually(
        lambda: (
            len([e for e in _events(api, "idle", "ScaledToZero") if e["message"][0] == "1"]) == 2
        ),
        "an Event for each scale to zero",
    )


async def test_without_builtin_scaling_replicas_are_left_alone(
    api: EmulatedApiServer, start_operator: Any, controllers: Any, eventually: Any
) -> None:
    operator = await start_operator(autoscale_interval=TICK)
    busy = Load(kv=0.99, running=8, waiting=20, busy=True)
    controllers("fixed", busy)
    controllers("viahpa", busy)
    await _create(api, llmdeployment("fixed", 2, None))
    await _create(
        api, llmdeployment("viahpa", 2, {"minReplicas": 1, "maxReplicas": 5, "mode": "hpa"})
    )
    hpa = await eventually(
        lambda: api.get("autoscaling/v2/horizontalpodautoscalers", "viahpa"), "the HPA"
    )
    assert hpa["spec"]["scaleTargetRef"]["name"] == "viahpa"
    await eventually(
        lambda: api.get(DEPLOYMENTS, "fixed-engine") and api.get(DEPLOYMENTS, "viahpa-engine"),
        "both Deployments",
    )
    await asyncio.sleep(20 * TICK)  # many autoscaler intervals
    for name in ("fixed", "viahpa"):
        cr = _cr(api, name)
        assert cr["spec"]["replicas"] == 2
        assert not _scale_writes(api, name)
        assert "lastScaleTime" not in cr["status"]
        # Not autoscaled by the operator: no kopf finalizer either.
        assert not cr["metadata"].get("finalizers")
    assert not operator.state.scaler.decisions

    # Switching to the builtin autoscaler removes the HPA (two autoscalers would fight).
    await _set_mode(api, "viahpa", "builtin")
    await eventually(
        lambda: api.get("autoscaling/v2/horizontalpodautoscalers", "viahpa") is None,
        "the HPA is deleted",
    )
    await eventually(lambda: _cr(api, "viahpa")["spec"]["replicas"] > 2, "now autoscaled")
    await eventually(lambda: _events(api, "viahpa", "Deleted"), "an Event for the deletion")
    await eventually(
        lambda: "lastScaleReason" in _cr(api, "viahpa")["status"], "the autoscaler's record"
    )

    # And back: the HPA again, and the autoscaler's record of its work goes with it.
    await _set_mode(api, "viahpa", "hpa")
    await eventually(
        lambda: api.get("autoscaling/v2/horizontalpodautoscalers", "viahpa"), "the HPA again"
    )
    await eventually(
        lambda: (
            not {"lastScaleTime", "lastScaleReason", "lastScaleChange"}
            & set(_cr(api, "viahpa")["status"])
        ),
        "the autoscaler's status fields removed",
    )


async def test_keda_mode_renders_a_scaled_object_or_says_keda_is_missing(
    api: EmulatedApiServer, start_operator: Any, eventually: Any
) -> None:
    await start_operator(autoscale_interval=TICK)
    scaling = {
        "minReplicas": 1,
        "maxReplicas": 3,
        "mode": "keda",
        "prometheusAddress": "http://prometheus.monitoring.svc:9090",
    }
    # No KEDA in the cluster: a clear Degraded condition; everything else is applied.
    await _create(api, llmdeployment("nokeda", 1, scaling))
    cr = await eventually(
        lambda: (
            (c := _cr(api, "nokeda")).get("status", {}).get("conditions")
            and _condition(c, "Degraded")["reason"] == "AutoscalerUnavailable"
            and c
        ),
        "Degraded: no ScaledObject kind",
    )
    assert "install KEDA" in _condition(cr, "Degraded")["message"]
    assert api.get(DEPLOYMENTS, "nokeda-engine") is not None

    # With KEDA's CRD: the ScaledObject, valid against KEDA's schema.
    api.resources["keda.sh/v1alpha1/scaledobjects"] = kmock.ResourceInfo(
        kind="ScaledObject",
        singular="scaledobject",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
    )
    await _create(api, llmdeployment("withkeda", 1, scaling))
    so = await eventually(
        lambda: api.get("keda.sh/v1alpha1/scaledobjects", "withkeda"), "the ScaledObject"
    )
    schema = yaml.safe_load(KEDA_SCHEMA.read_text())
    assert not list(OAS30Validator(schema).iter_errors(so))
    assert so["spec"]["scaleTargetRef"] == {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": "withkeda",
    }


async def test_two_operators_only_the_peering_leader_scales(
    api: EmulatedApiServer, start_operator: Any, controllers: Any, eventually: Any
) -> None:
    api.resources["kopf.dev/v1/kopfpeerings"] = kmock.ResourceInfo(
        kind="KopfPeering",
        singular="kopfpeering",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
    )
    peering = {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "fleetllm"}}
    async with api.post(
        f"/apis/kopf.dev/v1/namespaces/{NAMESPACE}/kopfpeerings", json=peering
    ) as response:
        assert response.status == 201, await response.text()

    def peers() -> int:
        return len((api.get("kopf.dev/v1/kopfpeerings", "fleetllm") or {}).get("status") or {})

    leader = await start_operator(
        autoscale_interval=TICK, priority=200, user_agent="fleetllm-operator-a"
    )
    await eventually(lambda: peers() == 1, "the first operator joins the peering")
    follower = await start_operator(
        autoscale_interval=TICK, priority=100, user_agent="fleetllm-operator-b"
    )
    await eventually(lambda: peers() == 2, "both operators in the peering")
    await asyncio.sleep(1.0)  # the second one sees the first and pauses

    controllers("shared", Load(kv=0.95, running=8, waiting=8))
    await _create(api, llmdeployment("shared", 1, {"minReplicas": 1, "maxReplicas": 3}))
    await eventually(lambda: _cr(api, "shared")["spec"]["replicas"] == 3, "scaled up")
    await asyncio.sleep(10 * TICK)
    writes = _scale_writes(api, "shared")
    assert writes and {r.headers.get("User-Agent") for r in writes} == {"fleetllm-operator-a"}
    assert leader.state.scaler.decisions and not follower.state.scaler.decisions
    assert follower.reconciles("shared") == 0
