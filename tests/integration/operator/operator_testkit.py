"""The autoscaler's surroundings, played by the test: engines whose /metrics report the load a
test sets (fleetllm's own exposition code), and the Deployment and ReplicaSet controllers and
the kubelet: pods follow the engine Deployment's replicas, are removed lowest
pod-deletion-cost first, and turn Ready when the test says so."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import kmock
from aiohttp import web
from deployment_manifests import smollm2
from engine_stats import load_stats
from kubeapi import CR_RESOURCE, NAMESPACE, EmulatedApiServer

from fleetllm.api.contract import selector_labels
from fleetllm.api.status import AdapterRecord, ReconciledStatus, ScaleRecord, field_names
from fleetllm.engine.engine_stats import EngineStats
from fleetllm.engine.metrics import EngineMetrics
from fleetllm.kube.client import DEFAULT_FIELD_MANAGER
from fleetllm.operator import adapter_loader, scaler
from fleetllm.operator.scaler import POD_DELETION_COST

MODEL = "smollm2-135m"
DEPLOYMENTS = "apps/v1/deployments"
CRS = "/apis/fleetllm.io/v1alpha1/namespaces/default/llmdeployments"
CR = "fleetllm.io/v1alpha1/llmdeployments"
MERGE_PATCH = {"Content-Type": "application/merge-patch+json"}


async def merge_patch(api: EmulatedApiServer, path: str, patch: dict[str, Any]) -> None:
    """A merge patch through the API server (as `kubectl patch --type merge`); it must apply."""
    async with api.patch(path, json=patch, headers=MERGE_PATCH) as response:
        assert response.status == 200, await response.text()


def smollm2_cr(replicas: int) -> dict[str, Any]:
    """The LLMDeployment `smol` in `default`: SmolLM2 on the CPU with `replicas` replicas."""
    return smollm2("smol", "default", maxModelLen=4096, replicas=replicas)


STATUS_WRITERS = {
    **dict.fromkeys(field_names(ReconciledStatus), DEFAULT_FIELD_MANAGER),
    **dict.fromkeys(field_names(ScaleRecord), scaler.FIELD_MANAGER),
    **dict.fromkeys(field_names(AdapterRecord), adapter_loader.FIELD_MANAGER),
}
"""Each LLMDeployment status field -> the field manager of its one writer: the reconciler
(the client's default manager), the builtin autoscaler or the adapter loader."""


def status_writers(api: EmulatedApiServer) -> dict[str, set[str]]:
    """Each LLMDeployment status field written through the API -> the field managers that
    wrote it (set it or removed it)."""
    writers: dict[str, set[str]] = {}
    for r in api.writes():
        if r.subresource != "status" or r.resource != kmock.resource(CR_RESOURCE):
            continue
        for key in (r.data or {}).get("status") or {}:
            writers.setdefault(key, set()).add(r.params.get("fieldManager", ""))
    return writers


def assert_one_writer_per_status_field(api: EmulatedApiServer) -> None:
    writers = status_writers(api)
    wrong = {k: w for k, w in writers.items() if w != {STATUS_WRITERS.get(k)}}
    assert not wrong, f"status fields with another writer than their own: {wrong}"


@dataclass
class Load:
    kv: float = 0.0
    running: int = 0
    waiting: int = 0
    busy: bool = False
    """Whether a request finishes between two scrapes (traffic the gauges may not show)."""


class FakeEngine:
    """One replica's /metrics: fleetllm's engine exposition, with the load the test sets; and
    its LoRA adapter API as vLLM serves it (/v1/models, /v1/load_lora_adapter,
    /v1/unload_lora_adapter), refusing the adapter folders in `refuse` with their message."""

    def __init__(self, load: Load, refuse: dict[str, str] | None = None) -> None:
        self.load = load
        self.metrics = EngineMetrics(MODEL, self._stats)
        self.scrapes = 0
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.refuse = refuse if refuse is not None else {}
        self.adapters: dict[str, str] = {}
        """Loaded adapters: name -> folder."""
        self.loads: list[tuple[str, str]] = []
        """Every load asked for: (name, folder)."""
        self.keys: set[str | None] = set()
        """The Authorization headers the adapter API got."""
        self.listings = 0

    def _stats(self) -> EngineStats:
        return load_stats(self.load.running, self.load.waiting, self.load.kv)

    async def _serve(self, _: web.Request) -> web.Response:
        self.scrapes += 1
        if self.load.busy:
            self.metrics.queue.observe(0.05)
        return web.Response(body=self.metrics.render(), content_type="text/plain")

    async def _models(self, request: web.Request) -> web.Response:
        self.keys.add(request.headers.get("Authorization"))
        self.listings += 1
        cards = [{"id": MODEL, "object": "model", "parent": None}]
        cards += [{"id": n, "object": "model", "parent": MODEL} for n in self.adapters]
        return web.json_response({"object": "list", "data": cards})

    async def _load(self, request: web.Request) -> web.Response:
        self.keys.add(request.headers.get("Authorization"))
        body = await request.json()
        name, path = body["lora_name"], body["lora_path"]
        self.loads.append((name, path))
        if path in self.refuse:
            return _error(400, self.refuse[path])
        if name in self.adapters:
            return _error(400, f"The lora adapter '{name}' has already been loaded.")
        self.adapters[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def _unload(self, request: web.Request) -> web.Response:
        self.keys.add(request.headers.get("Authorization"))
        name = (await request.json())["lora_name"]
        if self.adapters.pop(name, None) is None:
            return _error(404, f"The lora adapter '{name}' cannot be found.")
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/load_lora_adapter", self._load)
        app.router.add_post("/v1/unload_lora_adapter", self._unload)
        app.router.add_get("/metrics", self._serve)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


def _error(status: int, message: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "BadRequestError", "param": None, "code": status}},
        status=status,
    )


@dataclass
class Controllers:
    """The Deployment and ReplicaSet controllers and the kubelet, for one LLMDeployment."""

    api: EmulatedApiServer
    name: str
    load: Load = field(default_factory=Load)
    """What a new replica reports."""
    ready_after: float = 0.0
    namespace: str = NAMESPACE
    engines: dict[str, FakeEngine] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)
    refuse: dict[str, str] = field(default_factory=dict)
    """Adapter folders every replica refuses to load: folder -> the engine's message."""
    _count: int = 0

    async def _create_pod(self) -> None:
        self._count += 1
        pod = f"{self.name}-engine-{self._count}"
        engine = FakeEngine(Load(**vars(self.load)), self.refuse)
        await engine.start()
        self.engines[pod] = engine
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": pod, "labels": selector_labels(self.name)},
            "spec": {
                "containers": [
                    {
                        "name": "engine",
                        "image": "ghcr.io/fleetllm/fleetllm:test",
                        "ports": [{"name": "http", "containerPort": engine.port}],
                    }
                ]
            },
        }
        async with self.api.post(self.pods_path, json=body) as response:
            assert response.status == 201, await response.text()
        asyncio.get_running_loop().call_later(
            self.ready_after, lambda: asyncio.ensure_future(self._ready(pod))
        )

    async def _ready(self, pod: str) -> None:
        status = {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True"}],
        }
        async with self.api.patch(
            f"{self.pods_path}/{pod}/status",
            json={"status": status},
            headers=MERGE_PATCH,
        ) as response:
            assert response.status in (200, 404), await response.text()

    @property
    def pods_path(self) -> str:
        return f"/api/v1/namespaces/{self.namespace}/pods"

    def pods(self) -> list[dict[str, Any]]:
        """The pods the engine Deployment selects (a pull Job's pod carries another
        component label, as in a cluster)."""
        selector = selector_labels(self.name).items()
        return [
            p
            for p in self.api.list("v1/pods")
            if selector <= (p["metadata"].get("labels") or {}).items()
            and p["metadata"].get("namespace") == self.namespace
        ]

    async def run(self) -> None:
        while True:
            deployment = self.api.get(DEPLOYMENTS, f"{self.name}-engine", self.namespace)
            if deployment is not None:
                wanted = deployment["spec"].get("replicas", 1)
                pods = self.pods()
                for _ in range(wanted - len(pods)):
                    await self._create_pod()
                # The ReplicaSet's order: lowest pod-deletion-cost first, then the newest.
                surplus = sorted(
                    pods,
                    key=lambda p: (
                        int((p["metadata"].get("annotations") or {}).get(POD_DELETION_COST, 0)),
                        -int(p["metadata"]["name"].rsplit("-", 1)[1]),
                    ),
                )[: max(0, len(pods) - wanted)]
                for pod in surplus:
                    name = pod["metadata"]["name"]
                    async with self.api.delete(f"{self.pods_path}/{name}") as response:
                        assert response.status == 200
                    self.removed.append(name)
                    await self.engines.pop(name).stop()
            await asyncio.sleep(0.05)

    async def restart(self, pod: str) -> None:
        """The replica's engine dies and its pod goes; the ReplicaSet makes a new one."""
        await self.engines.pop(pod).stop()
        async with self.api.delete(f"{self.pods_path}/{pod}") as response:
            assert response.status == 200
        self.removed.append(pod)

    async def stop(self) -> None:
        for engine in self.engines.values():
            await engine.stop()
