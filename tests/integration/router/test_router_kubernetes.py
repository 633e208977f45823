"""Kubernetes discovery against an emulated API server (kmock): `fleetllm router serve
--discovery kubernetes`, logged in through a kubeconfig, routes to the EndpointSlices of each
LLMDeployment's Service, leaves terminating endpoints alone, and scales a model up from zero
through the scale subresource when its requests are held.

kmock ignores label selectors and watch resourceVersions and sets no resourceVersion: the
router filters slices by label itself and rebuilds its state on every list, which these gaps
cannot fool.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import kmock
import pytest
import pytest_asyncio
from router_testkit import EngineFleet, Process, async_wait_until, metric_sum

from fleetllm.operator.api import API_VERSION, GROUP, KIND, PLURAL, VERSION
from fleetllm.operator.render import LABEL_MODEL
from fleetllm.router.discovery import SERVICE_NAME_LABEL

pytestmark = pytest.mark.asyncio

NS = "default"
CRS = f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}"
SLICES = f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"
GUARD = 120.0


@pytest_asyncio.fixture()
async def api() -> AsyncIterator[Any]:
    server = kmock.KubernetesEmulator()
    server.resources.load_bundled()
    server.resources[f"{GROUP}/{VERSION}/{PLURAL}"] = kmock.ResourceInfo(
        kind=KIND,
        singular=KIND.lower(),
        namespaced=True,
        verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
        subresources={"status", "scale"},
    )
    async with server, kmock.Server(server):
        yield server


def _deployment(name: str, model: str, replicas: int, strategy: str) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "model": {"name": model, "source": "builtin://smollm2-135m"},
            "gpu": {"type": "cpu"},
            "replicas": replicas,
            "routing": {"strategy": strategy},
        },
    }


def _slice(name: str, service: str, model: str, port: int, **conditions: bool) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {SERVICE_NAME_LABEL: service, LABEL_MODEL: model},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True, **conditions}}],
    }


async def _write(api: Any, method: str, path: str, body: Any = None) -> None:
    async with api.request(method, path, json=body) as response:
        assert response.status in (200, 201), await response.text()


def _kubeconfig(api: Any, tmp_path: Path) -> Path:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters: [{{name: emu, cluster: {{server: '{str(api.url).rstrip('/')}'}}}}]\n"
        "users: [{name: anon, user: {}}]\n"
        "contexts: [{name: emu, context: {cluster: emu, user: anon}}]\n"
        "current-context: emu\n"
    )
    return kubeconfig


@pytest_asyncio.fixture()
async def router(api: Any, tmp_path: Path) -> AsyncIterator[Process]:
    kubeconfig = _kubeconfig(api, tmp_path)
    process = Process(
        ["router", "serve", "--discovery", "kubernetes", "--namespace", NS,
         "--hold-timeout", str(GUARD), "--scrape-interval", "0.2"],
        tmp_path / "router.log",
        env={"KUBECONFIG": str(kubeconfig)},
    )  # fmt: skip
    # The emulator answers from this event loop: wait for the router in a thread.
    await asyncio.to_thread(process.wait_healthy)
    yield process
    await asyncio.to_thread(process.close)


async def _upstream_counts(client: httpx.AsyncClient, router: Process) -> dict[str, float]:
    text = (await client.get(f"{router.url}/metrics")).text
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("fleetllm:router_upstream_requests_total{"):
            replica = line.split('replica="', 1)[1].split('"', 1)[0]
            counts[replica] = counts.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


async def test_routes_to_ready_endpoints_and_drains_terminating_ones(
    api: Any, router: Process, engines: EngineFleet
) -> None:
    await _write(api, "POST", CRS, _deployment("chat", "alpha", 3, "round-robin"))
    ports = [p.port for p in engines.alpha]
    for i, port in enumerate(ports):
        await _write(api, "POST", SLICES, _slice(f"chat-{i}", "chat", "alpha", port))
    # A slice of another model's Service, and an unlabelled one, must not leak in.
    await _write(api, "POST", SLICES, _slice("other-0", "other", "alpha", engines.beta.port))
    stray = _slice("stray-0", "chat", "alpha", engines.beta.port)
    del stray["metadata"]["labels"][LABEL_MODEL]
    await _write(api, "POST", SLICES, stray)

    async with httpx.AsyncClient(timeout=GUARD) as client:
        await async_wait_until(
            lambda: _has(_lister(client, router), ["alpha"]), "alpha discovered", GUARD
        )

        async def send(n: int) -> dict[str, float]:
            before = await _upstream_counts(client, router)
            for i in range(n):
                r = await client.post(
                    f"{router.url}/v1/completions",
                    json={"model": "alpha", "prompt": f"k8s {i}", "max_tokens": 2},
                )
                assert r.status_code == 200
            after = await _upstream_counts(client, router)
            return {k: after[k] - before.get(k, 0.0) for k in after if after[k] > before.get(k, 0)}

        urls = [p.url for p in engines.alpha]
        await async_wait_until(
            lambda: _replicas_up(client, router, urls), "all three endpoints up", GUARD
        )
        assert set(await send(6)) == set(urls)

        # The first endpoint starts terminating: it gets no new requests.
        terminating = _slice("chat-0", "chat", "alpha", ports[0])
        terminating["endpoints"][0]["conditions"] = {
            "ready": False, "serving": True, "terminating": True,
        }  # fmt: skip
        await _write(api, "PATCH", f"{SLICES}/chat-0", {"endpoints": terminating["endpoints"]})
        await async_wait_until(
            lambda: _replicas_up(client, router, urls[1:], down=urls[:1]),
            "terminating endpoint drained",
            GUARD,
        )
        assert set(await send(6)) == set(urls[1:])

        # Its slice goes away: so does the replica.
        await _write(api, "DELETE", f"{SLICES}/chat-0")

        async def forgotten() -> bool:
            text = (await client.get(f"{router.url}/metrics")).text
            return f'replica="{urls[0]}"' not in text.split("fleetllm:router_replica_up")[-1]

        await async_wait_until(forgotten, "deleted endpoint forgotten", GUARD)
        assert engines.beta.url not in await _upstream_counts(client, router)


async def _has(models: Callable[[], Any], wanted: list[str]) -> bool:
    return sorted(await models()) == wanted


async def _replicas_up(
    client: httpx.AsyncClient, router: Process, up: Sequence[str], down: Sequence[str] = ()
) -> bool:
    text = (await client.get(f"{router.url}/metrics")).text
    return all(metric_sum(text, "fleetllm:router_replica_up", replica=u) == 1 for u in up) and all(
        metric_sum(text, "fleetllm:router_replica_up", replica=d) == 0 for d in down
    )


async def test_scale_from_zero_patches_the_scale_subresource(
    api: Any, router: Process, gamma_engine: Callable[[], Process]
) -> None:
    await _write(api, "POST", CRS, _deployment("sleepy", "gamma", 0, "prefix"))
    async with httpx.AsyncClient(timeout=GUARD) as client:
        await async_wait_until(
            lambda: _has(_lister(client, router), ["gamma"]), "gamma discovered", GUARD
        )
        held = asyncio.create_task(
            client.post(
                f"{router.url}/v1/completions",
                json={"model": "gamma", "prompt": "wake", "max_tokens": 3},
            )
        )

        def scale_patches() -> list[Any]:
            return [
                r.data
                for r in api
                if r.method == kmock.method.PATCH and r.subresource == "scale"
                and r.name == "sleepy"
            ]  # fmt: skip

        await async_wait_until(lambda: bool(scale_patches()), "scale patch sent", GUARD)
        assert scale_patches()[0] == {"spec": {"replicas": 1}}
        key = (kmock.resource(f"{GROUP}/{VERSION}/{PLURAL}"), NS, "sleepy")
        assert api.objects[key].raw["spec"]["replicas"] == 1
        assert not held.done()

        # The operator's Deployment would now start a pod; its endpoint becomes ready.
        engine = await asyncio.to_thread(gamma_engine)
        await _write(api, "POST", SLICES, _slice("sleepy-0", "sleepy", "gamma", engine.port))
        response = await asyncio.wait_for(held, GUARD)
        assert response.status_code == 200
        assert response.json()["model"] == "gamma"


def _lister(client: httpx.AsyncClient, router: Process) -> Callable[[], Any]:
    async def models() -> list[str]:
        body = (await client.get(f"{router.url}/v1/models")).json()
        return [m["id"] for m in body["data"]]

    return models


async def test_api_keys_from_a_secret(api: Any, engines: EngineFleet, tmp_path: Path) -> None:
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "router-keys", "namespace": NS},
        "data": {"team-a": base64.b64encode(b"sk-from-secret").decode()},
    }
    await _write(api, "POST", f"/api/v1/namespaces/{NS}/secrets", secret)
    await _write(api, "POST", CRS, _deployment("beta", "beta", 1, "least-load"))
    await _write(api, "POST", SLICES, _slice("beta-0", "beta", "beta", engines.beta.port))
    process = Process(
        ["router", "serve", "--discovery", "kubernetes", "--namespace", NS,
         "--api-keys-secret", f"{NS}/router-keys"],
        tmp_path / "router.log",
        env={"KUBECONFIG": str(_kubeconfig(api, tmp_path))},
    )  # fmt: skip
    try:
        await asyncio.to_thread(process.wait_healthy)
        body = {"model": "beta", "prompt": "x", "max_tokens": 2}
        async with httpx.AsyncClient(timeout=GUARD) as client:

            async def status(key: str | None) -> int:
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                r = await client.post(f"{process.url}/v1/completions", json=body, headers=headers)
                return r.status_code

            await async_wait_until(
                lambda: _is(status("sk-from-secret"), 200), "key from the Secret accepted", GUARD
            )
            assert await status(None) == 401
            assert await status("sk-other") == 401
    finally:
        await asyncio.to_thread(process.close)


async def _is(value: Any, expected: Any) -> bool:
    return await value == expected
