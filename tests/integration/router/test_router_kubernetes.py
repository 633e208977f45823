"""Kubernetes discovery against the emulated API server (tests/kubeapi.py): `fleetllm router
serve --discovery kubernetes`, logged in through a kubeconfig, routes to the EndpointSlices of
the Service the operator rendered for each LLMDeployment (and to no other), leaves terminating
endpoints alone, keys models by namespace with `--all-namespaces` or several `--namespace`
(watching only those), sends each LLMDeployment's replicas the key derived for it from the
fleet's root (and no other model's, nor the global upstream key), and scales a model up from
zero through the scale subresource when its requests are held.

The emulator filters by label selector on the server side, as a real API server does, and
serves watches from a resourceVersion.
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
from aiohttp import web
from deployment_manifests import smollm2
from kubeapi import CR_RESOURCE, KMOCK_WARNINGS, EmulatedApiServer, emulated_api
from kubelogin import kubeconfig_for
from router_testkit import EngineFleet, Process, async_wait_until, metric_sum, serve_upstream

from fleetllm.api.contract import (
    ENGINE_KEY_ROOT_ENV,
    LABEL_MANAGED_BY,
    LABEL_MODEL,
    MANAGER,
    engine_key,
)
from fleetllm.api.deployment import API_VERSION, GROUP, KIND, PLURAL, VERSION
from fleetllm.router.discovery import SERVICE_NAME_LABEL

pytestmark = [pytest.mark.asyncio, KMOCK_WARNINGS]

NS = "default"
GUARD = 120.0


def _crs(ns: str = NS) -> str:
    return f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURAL}"


def _slices(ns: str = NS) -> str:
    return f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"


@pytest_asyncio.fixture()
async def api() -> AsyncIterator[EmulatedApiServer]:
    async with emulated_api() as server:
        yield server


async def _write(api: Any, method: str, path: str, body: Any = None) -> dict[str, Any]:
    headers = {"Content-Type": "application/merge-patch+json"} if method == "PATCH" else {}
    async with api.request(method, path, json=body, headers=headers) as response:
        assert response.status in (200, 201), await response.text()
        return dict(await response.json())


async def _model(
    api: Any, name: str, model: str, replicas: int, strategy: str, ns: str = NS
) -> str:
    """An LLMDeployment and the Service the operator renders for it (named after it,
    labelled, controlled by it); the Service's uid."""
    deployment = _cr(name, model, ns)
    deployment["spec"] |= {"replicas": replicas, "routing": {"strategy": strategy}}
    created = await _write(api, "POST", _crs(ns), deployment)
    owner = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": name,
        "uid": created["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
    return await _service(api, name, model, ns, [owner])


async def _service(api: Any, name: str, model: str, ns: str, owners: list[dict[str, Any]]) -> str:
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": {LABEL_MANAGED_BY: MANAGER, LABEL_MODEL: model},
            "ownerReferences": owners,
        },
        "spec": {
            "clusterIP": "None",
            "selector": {"app.kubernetes.io/instance": name},
            "ports": [{"name": "http", "port": 8000, "targetPort": 8000, "protocol": "TCP"}],
        },
    }
    created = await _write(api, "POST", f"/api/v1/namespaces/{ns}/services", service)
    return str(created["metadata"]["uid"])


def _slice(
    name: str, service: str, service_uid: str | None, model: str, port: int, ns: str = NS
) -> dict[str, Any]:
    """As the EndpointSlice controller writes it: the Service's labels, the service-name
    label, the Service as controller."""
    meta: dict[str, Any] = {
        "name": name,
        "namespace": ns,
        "labels": {SERVICE_NAME_LABEL: service, LABEL_MODEL: model, LABEL_MANAGED_BY: MANAGER},
    }
    if service_uid is not None:
        meta["ownerReferences"] = [
            {
                "apiVersion": "v1",
                "kind": "Service",
                "name": service,
                "uid": service_uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": meta,
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True}}],
    }


def _router(api: Any, tmp_path: Path, *extra: str, env: dict[str, str] | None = None) -> Process:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(kubeconfig_for(str(api.url).rstrip("/")))
    return Process(
        ["router", "serve", "--discovery", "kubernetes", "--hold-timeout", str(GUARD),
         "--scrape-interval", "0.2", *extra],
        tmp_path / "router.log",
        env={"KUBECONFIG": str(kubeconfig), **(env or {})},
    )  # fmt: skip


@pytest_asyncio.fixture()
async def router(api: Any, tmp_path: Path) -> AsyncIterator[Process]:
    process = _router(api, tmp_path, "--namespace", NS)
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


async def _send(client: httpx.AsyncClient, router: Process, model: str, n: int) -> dict[str, float]:
    """Send n completions for `model`; which replicas served them."""
    before = await _upstream_counts(client, router)
    for i in range(n):
        r = await client.post(
            f"{router.url}/v1/completions",
            json={"model": model, "prompt": f"k8s {i}", "max_tokens": 2},
        )
        assert r.status_code == 200, r.text
    after = await _upstream_counts(client, router)
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] > before.get(k, 0)}


async def test_routes_to_ready_endpoints_of_the_operators_service_only(
    api: Any, router: Process, engines: EngineFleet
) -> None:
    uid = await _model(api, "chat", "alpha", 3, "round-robin")
    ports = [p.port for p in engines.alpha]
    for i, port in enumerate(ports):
        await _write(api, "POST", _slices(), _slice(f"chat-{i}", "chat", uid, "alpha", port))
    beta = engines.beta.port
    # None of these may take alpha's traffic: a slice of another Service; a slice that names
    # chat's Service by label but is not controlled by it; one without the operator's label
    # (the server filters it out); and the slices of a Service named like an LLMDeployment
    # but not controlled by it.
    await _write(api, "POST", _slices(), _slice("other-0", "other", "uid-other", "alpha", beta))
    await _write(api, "POST", _slices(), _slice("forged-0", "chat", "forged", "alpha", beta))
    await _write(api, "POST", _slices(), _slice("bare-0", "chat", None, "alpha", beta))
    unlabelled = _slice("unlabelled-0", "chat", uid, "alpha", beta)
    del unlabelled["metadata"]["labels"][LABEL_MANAGED_BY]
    await _write(api, "POST", _slices(), unlabelled)
    await _write(api, "POST", _crs(), _cr("lookalike", "gamma"))
    foreign = await _service(api, "lookalike", "gamma", NS, owners=[])
    await _write(api, "POST", _slices(), _slice("lookalike-0", "lookalike", foreign, "gamma", beta))

    async with httpx.AsyncClient(timeout=GUARD) as client:
        await async_wait_until(
            lambda: _has(_lister(client, router), ["alpha", "gamma"]), "models discovered", GUARD
        )
        urls = [p.url for p in engines.alpha]
        await async_wait_until(
            lambda: _replicas_up(client, router, urls), "all three endpoints up", GUARD
        )
        assert set(await _send(client, router, "alpha", 6)) == set(urls)
        # The namespace-qualified id reaches the same model.
        assert set(await _send(client, router, f"{NS}/alpha", 3)) <= set(urls)

        # The first endpoint starts terminating: it gets no new requests.
        terminating = _slice("chat-0", "chat", uid, "alpha", ports[0])
        terminating["endpoints"][0]["conditions"] = {
            "ready": False, "serving": True, "terminating": True,
        }  # fmt: skip
        await _write(api, "PATCH", f"{_slices()}/chat-0", {"endpoints": terminating["endpoints"]})
        await async_wait_until(
            lambda: _replicas_up(client, router, urls[1:], down=urls[:1]),
            "terminating endpoint drained",
            GUARD,
        )
        assert set(await _send(client, router, "alpha", 6)) == set(urls[1:])

        # Its slice goes away: so does the replica.
        await _write(api, "DELETE", f"{_slices()}/chat-0")

        async def forgotten() -> bool:
            text = (await client.get(f"{router.url}/metrics")).text
            return f'replica="{urls[0]}"' not in text.split("fleetllm:router_replica_up")[-1]

        await async_wait_until(forgotten, "deleted endpoint forgotten", GUARD)
        assert engines.beta.url not in await _upstream_counts(client, router)

    # Every watch the router opened asked the server to filter children by label.
    watches = [r for r in api if r.action == kmock.action.WATCH and r.resource is not None]
    by_plural = {r.resource.plural: r.params.get("labelSelector") for r in watches}
    assert by_plural["services"] == f"{LABEL_MANAGED_BY}={MANAGER}"
    assert by_plural["endpointslices"] == f"{LABEL_MANAGED_BY}={MANAGER}"
    assert all(r.params.get("allowWatchBookmarks") == "true" for r in watches)


def _cr(name: str, model: str, ns: str = NS) -> dict[str, Any]:
    return smollm2(name, ns, served_name=model)


@pytest.mark.parametrize(
    "scope",
    [("--all-namespaces",), ("--namespace", "team-a", "--namespace", "team-b")],
    ids=["all-namespaces", "two-namespaces"],
)
async def test_all_or_several_namespaces_key_models_by_namespace(
    api: Any, engines: EngineFleet, tmp_path: Path, scope: tuple[str, ...]
) -> None:
    """Cluster-wide, or namespace by namespace (as a namespace-scoped install, which may
    not list across namespaces, runs it): the same fleet."""
    first, second = engines.alpha[0], engines.alpha[1]
    uid_a = await _model(api, "chat", "alpha", 1, "least-load", ns="team-a")
    await _write(
        api, "POST", _slices("team-a"), _slice("a", "chat", uid_a, "alpha", first.port, "team-a")
    )
    uid_b = await _model(api, "chat", "alpha", 1, "least-load", ns="team-b")
    await _write(
        api, "POST", _slices("team-b"), _slice("b", "chat", uid_b, "alpha", second.port, "team-b")
    )
    # team-b's slice claiming team-a's Service by name and uid is still team-b's object: the
    # slice must live in the Service's namespace.
    await _write(
        api, "POST", _slices("team-b"), _slice("x", "chat", uid_a, "alpha", second.port, "team-b")
    )

    # A namespace outside the watched ones is not seen.
    await _model(api, "other", "gamma", 1, "least-load", ns="team-c")
    extra = ["team-c/gamma"] if scope == ("--all-namespaces",) else []

    router = _router(api, tmp_path, *scope)
    await asyncio.to_thread(router.wait_healthy)
    try:
        async with httpx.AsyncClient(timeout=GUARD) as client:
            await async_wait_until(
                lambda: _has(_lister(client, router), ["team-a/alpha", "team-b/alpha", *extra]),
                "both namespaces' models discovered",
                GUARD,
            )
            await async_wait_until(
                lambda: _replicas_up(client, router, [first.url, second.url]), "replicas up", GUARD
            )
            assert set(await _send(client, router, "team-a/alpha", 4)) == {first.url}
            assert set(await _send(client, router, "team-b/alpha", 4)) == {second.url}
            # Two namespaces serve the plain name: refused with the ids to use, whatever
            # namespace was given first (traffic never moves to it silently).
            r = await client.post(
                f"{router.url}/v1/completions",
                json={"model": "alpha", "prompt": "x", "max_tokens": 2},
            )
            assert r.status_code == 404
            assert "team-a/alpha, team-b/alpha" in r.json()["error"]["message"]

            # Once team-b's model is gone, the plain name is unambiguous again.
            await _write(api, "DELETE", f"{_crs('team-b')}/chat")
            await async_wait_until(
                lambda: _has(_lister(client, router), ["team-a/alpha", *extra]),
                "team-b gone",
                GUARD,
            )
            assert set(await _send(client, router, "alpha", 3)) == {first.url}
    finally:
        await asyncio.to_thread(router.close)


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
    uid = await _model(api, "sleepy", "gamma", 0, "prefix")
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
        assert api.get(CR_RESOURCE, "sleepy")["spec"]["replicas"] == 1
        assert not held.done()

        # The operator's Deployment would now start a pod; its endpoint becomes ready.
        engine = await asyncio.to_thread(gamma_engine)
        await _write(
            api, "POST", _slices(), _slice("sleepy-0", "sleepy", uid, "gamma", engine.port)
        )
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
    uid = await _model(api, "beta", "beta", 1, "least-load")
    await _write(api, "POST", _slices(), _slice("beta-0", "beta", uid, "beta", engines.beta.port))
    process = _router(api, tmp_path, "--namespace", NS, "--api-keys-secret", f"{NS}/router-keys")
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


class KeyedEngine:
    """A stand-in engine that, like ours and vLLM started with a key, answers 401 to any other
    key; /health and /metrics stay open. `seen` is the Authorization of every request (the
    router's reads of the model card included), `completions` that of each completion."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.key = ""
        self.seen: list[str] = []
        self.completions: list[str] = []

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/health":
            return web.Response()
        if request.path == "/metrics":
            return web.Response(text="vllm:num_requests_waiting 0\n")
        self.seen.append(request.headers.get("Authorization", ""))
        if request.path == "/v1/completions":
            self.completions.append(request.headers.get("Authorization", ""))
        if request.headers.get("Authorization") != f"Bearer {self.key}":
            return web.json_response({"error": {"message": "bad key", "code": 401}}, status=401)
        return web.json_response({"model": self.model, "choices": [{"text": "ok"}]})


async def test_each_models_replicas_get_their_own_derived_key(api: Any, tmp_path: Path) -> None:
    root = "fleet-root-for-the-test"
    engines = {"alpha": KeyedEngine("alpha"), "beta": KeyedEngine("beta")}
    async with serve_upstream(engines["alpha"]) as alpha, serve_upstream(engines["beta"]) as beta:
        for name, url in (("alpha", alpha), ("beta", beta)):
            service_uid = await _model(api, f"ld-{name}", name, 1, "least-load")
            uid = (await _write(api, "GET", f"{_crs()}/ld-{name}"))["metadata"]["uid"]
            engines[name].key = engine_key(root, NS, f"ld-{name}", uid)
            port = int(url.rsplit(":", 1)[1])
            await _write(api, "POST", _slices(), _slice(f"{name}-0", f"ld-{name}", service_uid,
                                                        name, port))  # fmt: skip
        process = _router(
            api, tmp_path, "--namespace", NS, "--upstream-api-key", "sk-global",
            env={ENGINE_KEY_ROOT_ENV: root},
        )  # fmt: skip
        try:
            await asyncio.to_thread(process.wait_healthy)
            async with httpx.AsyncClient(timeout=GUARD) as client:
                await async_wait_until(
                    lambda: _has(_lister(client, process), ["alpha", "beta"]), "models", GUARD
                )
                for name in ("alpha", "beta", "alpha", "beta"):
                    r = await client.post(
                        f"{process.url}/v1/completions",
                        json={"model": name, "prompt": "x", "max_tokens": 2},
                    )
                    assert r.status_code == 200, r.text
                    assert r.json()["model"] == name
                # A replica still on another key (a rotation it has not picked up): the
                # client, whose key was fine, gets 502 naming the router's key, not a 401.
                derived, engines["alpha"].key = engines["alpha"].key, "a key from before"
                r = await client.post(
                    f"{process.url}/v1/completions",
                    json={"model": "alpha", "prompt": "x", "max_tokens": 2},
                )
                assert r.status_code == 502, r.text
                assert "refused the router's key" in r.json()["error"]["message"]
                engines["alpha"].key = derived
        finally:
            await asyncio.to_thread(process.close)
        log = process.log_text()
    alpha_key, beta_key = engines["alpha"].key, engines["beta"].key
    assert "a replica refused the router's engine key" in log
    assert alpha_key != beta_key
    # Each engine saw its own key only: never the other's, never the global one.
    assert set(engines["alpha"].seen) == {f"Bearer {alpha_key}"}
    assert set(engines["beta"].seen) == {f"Bearer {beta_key}"}
    assert engines["beta"].completions == [f"Bearer {beta_key}"] * 2
    assert alpha_key not in log and beta_key not in log and root not in log
