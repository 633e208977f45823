"""Least privilege, derived from the code's own calls.

The chart is rendered (cluster-wide, and namespace-scoped for two namespaces); the operator
(kopf with the production settings and peering, its reconciler and autoscaler) and the router
(the real `fleetllm router serve` process, with the arguments the chart gives it) then run
against the emulated API server through a whole life, in each watched namespace:
- a model on a claim the operator reads, at zero replicas: the operator plans and applies its
  children, writes status and Events; a client asks the router for it, which scales it up
  from zero; the operator follows;
- a model the operator's autoscaler scales down (idle replicas, reported by engines' /metrics;
  pods annotated with their deletion cost first);
- a model scaled by an HPA, then by a KEDA ScaledObject, then by the operator again: each
  rendered in turn, the previous one deleted;
- a model with a LoRA adapter from a hub: pulled by a Job into the model cache, then removed
  (its Job deleted).
Every request the server saw is turned into the
attributes Kubernetes authorizes (tests/rbac.py), and the rendered RBAC must allow every one
of them and grant nothing else: no verb, resource or namespace that no call used, no
wildcard, no Secret beyond the router's one key Secret, by name.
"""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import kmock
import pytest
from helmchart import NAMESPACE as RELEASE_NAMESPACE
from helmchart import by_kind, render
from kubeapi import KMOCK_WARNINGS, EmulatedApiServer
from kubelogin import kubeconfig_for
from local_services import free_port, stop_process
from operator_testkit import Load, merge_patch
from rbac import Attributes, Grant, allows, attributes, grants, wildcards

from fleetllm.api.deployment import API_VERSION, GROUP, KIND, PLURAL, VERSION
from fleetllm.cli import build_parser
from fleetllm.operator.handlers import make_settings
from fleetllm.planner.settings import ModelCache, OperatorConfig

pytestmark = [
    pytest.mark.asyncio,
    pytest.mark.slow,  # about 20 s per install mode
    KMOCK_WARNINGS,
]

CLUSTER_NAMESPACES = ["default", "team-x"]
KEY = "sk-rbac-test-key"
MODEL = "smollm2-135m"
# Children the operator watches and the router follows: always by the operator's label.
CHILD_SELECTOR = "app.kubernetes.io/managed-by=fleetllm"
CHILD_KINDS = {"configmaps", "services", "deployments", "poddisruptionbudgets", "endpointslices"}
CR_RESOURCE = f"{GROUP}/{VERSION}/{PLURAL}"
HPAS = "autoscaling/v2/horizontalpodautoscalers"
JOBS = "batch/v1/jobs"
SCALEDOBJECTS = "keda.sh/v1alpha1/scaledobjects"
HPA = {"minReplicas": 1, "maxReplicas": 3, "mode": "hpa"}
KEDA = {"mode": "keda", "prometheusAddress": "http://prometheus.monitoring.svc:9090"}


def _container_args(objects: list[dict[str, Any]], component: str) -> list[str]:
    (deployment,) = [
        d
        for d in by_kind(objects, "Deployment")
        if d["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return [*container["command"][1:], *container["args"]]


async def _post(api: EmulatedApiServer, path: str, body: dict[str, Any]) -> None:
    async with api.request("POST", path, json=body) as response:
        assert response.status in (200, 201), await response.text()


def _register_crds(api: EmulatedApiServer) -> None:
    """The kinds of CRDs the cluster has: kopf's peering objects and KEDA's ScaledObject."""
    for resource, kind, namespaced in (
        ("kopf.dev/v1/clusterkopfpeerings", "ClusterKopfPeering", False),
        ("kopf.dev/v1/kopfpeerings", "KopfPeering", True),
        ("keda.sh/v1alpha1/scaledobjects", "ScaledObject", True),
    ):
        api.resources[resource] = kmock.ResourceInfo(
            kind=kind,
            singular=kind.lower(),
            namespaced=namespaced,
            verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
        )


async def _seed(api: EmulatedApiServer, objects: list[dict[str, Any]], homes: list[str]) -> None:
    """What exists before the control plane starts: the chart's peering objects, the router's
    key Secret, and in each namespace a claim holding the model."""
    for peering in by_kind(objects, "ClusterKopfPeering"):
        await _post(api, "/apis/kopf.dev/v1/clusterkopfpeerings", peering)
    for peering in by_kind(objects, "KopfPeering"):
        namespace = peering["metadata"]["namespace"]
        await _post(api, f"/apis/kopf.dev/v1/namespaces/{namespace}/kopfpeerings", peering)
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "fleetllm-router-keys", "namespace": RELEASE_NAMESPACE},
        "data": {"rbac-test": base64.b64encode(KEY.encode()).decode()},
    }
    await _post(api, f"/api/v1/namespaces/{RELEASE_NAMESPACE}/secrets", secret)
    for namespace in homes:
        claim = {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "models", "namespace": namespace},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "resources": {"requests": {"storage": "1Gi"}},
            },
        }
        await _post(api, f"/api/v1/namespaces/{namespace}/persistentvolumeclaims", claim)


def _llmdeployment(
    namespace: str, name: str, replicas: int, scaling: dict[str, Any] | None = None
) -> dict[str, Any]:
    # One served model name each: LLMDeployments of one namespace serving the same name would
    # share one route, whose demand goes to the first of them by name.
    model = {"name": f"{name}-model", "source": "builtin://smollm2-135m"}
    if name == "smol":
        # On a claim: the operator reads its access modes.
        model = {"name": MODEL, "source": "pvc://models/smollm2", "architecture": "SmolLM2-135M"}
    spec: dict[str, Any] = {
        "model": model,
        "gpu": {"type": "cpu"},
        "maxModelLen": 2048,
        "replicas": replicas,
    }
    if scaling is not None:
        spec["scaling"] = scaling
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


async def _patch_scaling(api: EmulatedApiServer, namespace: str, scaling: Any) -> None:
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/viahpa"
    await merge_patch(api, path, {"spec": {"scaling": scaling}})


class RouterProcess:
    """`fleetllm router serve` with the chart's arguments, logged in through a kubeconfig."""

    def __init__(self, args: list[str], kubeconfig: Path, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = log.open("wb")
        args = [a for a in args if not a.startswith(("--port=", "--shutdown-timeout="))]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fleetllm.cli", *args, "--host=127.0.0.1",
             f"--port={self.port}", "--hold-timeout=1", "--shutdown-timeout=1"],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "KUBECONFIG": str(kubeconfig)},
        )  # fmt: skip
        self.log = log

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()


async def _live_control_plane(
    api: EmulatedApiServer,
    start_operator: Callable[..., Any],
    controllers: Callable[..., Any],
    eventually: Callable[..., Any],
    tmp_path: Path,
    objects: list[dict[str, Any]],
) -> list[str]:
    """Run the operator and the router as the chart configures them through one life of the
    fleet; the namespaces the models lived in."""
    parser = build_parser()
    operator_args = parser.parse_args(_container_args(objects, "operator"))
    namespaces = None if operator_args.all_namespaces else operator_args.namespaces
    homes = namespaces or CLUSTER_NAMESPACES
    _register_crds(api)
    await _seed(api, objects, homes)

    settings = make_settings(
        standalone=operator_args.standalone,
        peering=operator_args.peering,
        priority=1,
        namespaces=namespaces,
    )
    operator = await start_operator(
        settings=settings,
        namespaces=namespaces,
        autoscale_interval=0.2,
        adapter_interval=1.0,
        config=OperatorConfig(model_cache=ModelCache("models")),
    )
    kubeconfig = tmp_path / "router-kubeconfig"
    kubeconfig.write_text(kubeconfig_for(str(api.url).rstrip("/")))
    router = RouterProcess(_container_args(objects, "router"), kubeconfig, tmp_path / "router.log")
    try:
        idle = {"minReplicas": 1, "maxReplicas": 2, "scaleDownDelaySeconds": 1}
        for namespace in homes:
            controllers("auto", Load(), namespace=namespace)
            path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"
            await _post(api, path, _llmdeployment(namespace, "smol", 0))
            await _post(api, path, _llmdeployment(namespace, "auto", 2, idle))
            await _post(api, path, _llmdeployment(namespace, "viahpa", 1, HPA))

        def planned() -> bool:
            return all(
                (api.get(CR_RESOURCE, "smol", ns) or {}).get("status", {}).get("plan")
                and api.get("apps/v1/deployments", "smol-engine", ns)
                for ns in homes
            )

        await eventually(planned, "every LLMDeployment planned, its children applied", 60)

        async with httpx.AsyncClient(timeout=30) as client:

            async def router_ready() -> bool:
                try:
                    return (await client.get(f"{router.url}/health")).status_code == 200
                except httpx.TransportError:
                    return False

            deadline = asyncio.get_running_loop().time() + 60
            while not await router_ready():
                assert router.proc.poll() is None, router.log.read_text()
                assert asyncio.get_running_loop().time() < deadline, router.log.read_text()
                await asyncio.sleep(0.2)
            # Held (no replica runs), then 503: meanwhile the router scales each model up.
            answers = await asyncio.gather(
                *(
                    client.post(
                        f"{router.url}/v1/completions",
                        json={"model": f"{ns}/{MODEL}", "prompt": "hi", "max_tokens": 1},
                        headers={"Authorization": f"Bearer {KEY}"},
                    )
                    for ns in homes
                )
            )
            assert [a.status_code for a in answers] == [503] * len(homes), [a.text for a in answers]

        def scaled_up() -> bool:
            return all(
                (api.get("apps/v1/deployments", "smol-engine", ns) or {})
                .get("spec", {})
                .get("replicas")
                == 1
                for ns in homes
            )

        await eventually(scaled_up, "the router's scale-up applied by the operator", 60)

        def autoscaled_down() -> bool:
            return all(
                (api.get(CR_RESOURCE, "auto", ns) or {}).get("spec", {}).get("replicas") == 1
                for ns in homes
            )

        await eventually(autoscaled_down, "the autoscaler's scale-down of idle replicas", 60)

        # spec.scaling.mode: hpa, then keda, then the operator's own again.
        def only(resource: str | None) -> bool:
            return all(
                (api.get(HPAS, "viahpa", ns) is not None) == (resource == HPAS)
                and (api.get(SCALEDOBJECTS, "viahpa", ns) is not None)
                == (resource == SCALEDOBJECTS)
                for ns in homes
            )

        await eventually(lambda: only(HPAS), "the HPAs", 60)
        for namespace in homes:
            await _patch_scaling(api, namespace, KEDA)
        await eventually(lambda: only(SCALEDOBJECTS), "ScaledObjects instead of HPAs", 60)
        for namespace in homes:
            await _patch_scaling(api, namespace, {"mode": None, "prometheusAddress": None})
        await eventually(lambda: only(None), "neither, the operator scales again", 60)
        await _adapter_pulled_loaded_and_removed(api, eventually, homes)
    finally:
        router.stop()
        await operator.stop()
    return homes


async def _adapter_pulled_loaded_and_removed(
    api: EmulatedApiServer, eventually: Callable[..., Any], homes: list[str]
) -> None:
    """A model at zero replicas with an adapter from a hub, in each namespace: the Job
    controller's part, each pull succeeds; then the adapter goes again."""
    for namespace in homes:
        lora = _llmdeployment(namespace, "lora", 0)
        lora["spec"] |= {"lora": {}, "adapters": [{"name": "sql", "source": "hf://o/sql"}]}
        await _post(api, f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}", lora)

    def jobs() -> list[dict[str, Any]]:
        return [j for j in api.list(JOBS) if j["metadata"].get("namespace") in homes]

    await eventually(lambda: len(jobs()) == len(homes), "a pull Job in each namespace", 60)
    for job in jobs():
        meta = job["metadata"]
        path = f"/apis/batch/v1/namespaces/{meta['namespace']}/jobs/{meta['name']}/status"
        await merge_patch(api, path, {"status": {"succeeded": 1}})

    def pulled() -> bool:
        return all(
            [a.get("reason") for a in (api.get(CR_RESOURCE, "lora", ns) or {})
             .get("status", {}).get("adapters") or []] == ["NoReplicaReady"]
            for ns in homes
        )  # fmt: skip

    await eventually(pulled, "each adapter pulled, waiting for a replica", 60)
    for namespace in homes:
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/lora"
        await merge_patch(api, path, {"spec": {"adapters": []}})
    await eventually(lambda: not jobs(), "the pull Jobs deleted", 60)


def _calls(api: EmulatedApiServer, agent: Callable[[str], bool]) -> list[Attributes]:
    created = {id(r) for r in api.created_by_apply}
    calls = []
    for request in api:
        if not agent(request.headers.get("User-Agent", "")):
            continue
        calls += attributes(
            request.method.value,
            request.url.path,
            request.params,
            created=id(request) in created,
        )
    return calls


def _unused(granted: list[Grant], calls: list[Attributes]) -> list[Grant]:
    return [g for g in granted if not any(allows(g, c) for c in calls)]


def _denied(granted: list[Grant], calls: list[Attributes]) -> set[Attributes]:
    return {c for c in calls if not any(allows(g, c) for g in granted)}


@pytest.mark.parametrize("value_set", [None, "namespaced-values.yaml"])
async def test_rbac_grants_exactly_what_the_operator_and_the_router_use(
    api: EmulatedApiServer,
    start_operator: Callable[..., Any],
    controllers: Callable[..., Any],
    eventually: Callable[..., Any],
    tmp_path: Path,
    value_set: str | None,
) -> None:
    objects = render(value_set)
    homes = await _live_control_plane(
        api, start_operator, controllers, eventually, tmp_path, objects
    )

    roles = by_kind(objects, "Role") + by_kind(objects, "ClusterRole")
    assert wildcards(roles) == []
    # Secrets can be read and written one by one (the engines' key Secrets), never listed or
    # watched: nothing can enumerate them.
    for role in by_kind(objects, "ClusterRole") + by_kind(objects, "Role"):
        for rule in role["rules"]:
            if "secrets" in rule["resources"]:
                assert not {"list", "watch", "delete"} & set(rule["verbs"]), role
    if value_set == "namespaced-values.yaml":
        # Namespace-scoped: no cluster-wide grant of any kind.
        assert by_kind(objects, "ClusterRole") == [] == by_kind(objects, "ClusterRoleBinding")

    components = {
        "fleetllm-router": lambda agent: agent == "fleetllm-router",
        # kopf and the reconciler share the operator's ServiceAccount.
        "fleetllm-operator": lambda agent: agent.startswith(("kopf/", "fleetllm-operator")),
    }
    for account, agent in components.items():
        calls = _calls(api, agent)
        granted = grants(objects, account, RELEASE_NAMESPACE)
        assert calls and granted, account
        denied = _denied(granted, calls)
        assert not denied, f"{account} makes calls its RBAC denies: {sorted(map(str, denied))}"
        unused = _unused(granted, calls)
        assert not unused, f"{account} is granted what its code never used: {unused}"
        for namespace in homes:
            assert any(c.namespace == namespace for c in calls), (account, namespace)

    # Secrets: the router's key Secret, by name, in its own namespace; the operator's calls
    # are to the engine-key Secrets of the LLMDeployments alone.
    secret_calls = {
        (c.verb, c.namespace, c.name)
        for c in _calls(api, lambda agent: agent.startswith(("kopf/", "fleetllm-")))
        if c.resource == "secrets"
    }
    assert ("get", RELEASE_NAMESPACE, "fleetllm-router-keys") in secret_calls
    others = secret_calls - {("get", RELEASE_NAMESPACE, "fleetllm-router-keys")}
    assert others and all(name.endswith("-engine-key") for _, _, name in others), others

    # Watches and lists of children are filtered by the API server, by the operator's label;
    # pods by the engine labels of one LLMDeployment.
    for request in api:
        agent = request.headers.get("User-Agent", "")
        if not agent.startswith(("kopf/", "fleetllm-")):
            continue
        for call in attributes(request.method.value, request.url.path, request.params):
            if call.resource in CHILD_KINDS and call.verb in ("list", "watch"):
                assert request.params.get("labelSelector") == CHILD_SELECTOR, (agent, call)
            if call.resource == "pods" and call.verb in ("list", "watch"):
                assert "app.kubernetes.io/instance=" in request.params["labelSelector"]
