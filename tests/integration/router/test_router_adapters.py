"""LoRA adapters through the router, against scripted replicas that speak vLLM's adapter API
(/v1/models with `parent`, /v1/load_lora_adapter, /v1/unload_lora_adapter) and answer a request
for an adapter they do not hold with vLLM's 404: a request for an adapter goes to a replica that
holds it; one that none holds is loaded first, once, on the least loaded replica, with a bound
on loads in flight; a refused load is answered 404 with the engine's reason and backed off,
never retried at once; /v1/models lists adapters with their model as parent."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest
from aiohttp import web
from router_testkit import async_wait_until, serve_router, serve_upstream

from fleetllm.router.config import RouterSettings
from fleetllm.router.discovery import ModelRoute, ReplicaRef, StaticDiscovery
from fleetllm.router.lora import AdapterRoute
from fleetllm.router.server import Router

pytestmark = pytest.mark.asyncio

BASE = "base"
FAST = RouterSettings(backoff_base=0.05, backoff_max=0.2, scrape_interval=0.05)


class LoraReplica:
    """A scripted replica of BASE: it serves what it holds, loads what it is asked to unless
    the folder is in `refuse`, and counts everything."""

    def __init__(self, holds: dict[str, str] | None = None, load_delay: float = 0.0) -> None:
        self.holds = dict(holds or {})
        self.load_delay = load_delay
        self.refuse: dict[str, str] = {}
        self.served: list[str] = []
        self.loads: list[str] = []
        self.loading = 0
        self.most_loading = 0

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/health":
            return web.Response()
        if request.path == "/metrics":
            return web.Response(text="vllm:num_requests_waiting 0\n")
        if request.path == "/v1/models":
            cards = [{"id": BASE, "object": "model", "parent": None}]
            cards += [{"id": n, "object": "model", "parent": BASE} for n in self.holds]
            return web.json_response({"object": "list", "data": cards})
        body = await request.json()
        if request.path == "/v1/load_lora_adapter":
            return await self._load(body["lora_name"], body["lora_path"])
        model = body["model"]
        if model != BASE and model not in self.holds:
            message = f"The model `{model}` does not exist."
            return web.json_response({"error": {"message": message, "code": 404}}, status=404)
        self.served.append(model)
        return web.json_response({"model": model, "choices": [{"text": "ok"}]})

    async def _load(self, name: str, path: str) -> web.Response:
        self.loads.append(name)
        self.loading += 1
        self.most_loading = max(self.most_loading, self.loading)
        try:
            await asyncio.sleep(self.load_delay)
        finally:
            self.loading -= 1
        if path in self.refuse:
            return web.json_response({"error": {"message": self.refuse[path]}}, status=400)
        self.holds[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


def fleet(path: Path, urls: list[str], adapters: dict[str, str]) -> StaticDiscovery:
    doc = {"models": {BASE: {"replicas": urls, "adapters": adapters}}}
    path.write_text(json.dumps(doc))
    return StaticDiscovery(path, poll_interval=0.05)


def serving(router: Router) -> bool:
    model = router.pool.models.get(BASE)
    return model is not None and model.has_available()


def holding(router: Router) -> bool:
    model = router.pool.models.get(BASE)
    return model is not None and any(r.adapters for r in model.available(time.monotonic()))


async def ask(
    client: httpx.AsyncClient, url: str, model: str, prompt: str = "hi"
) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 1}
    return await client.post(f"{url}/v1/completions", json=body)


async def test_adapter_requests_land_on_a_holder_and_unknown_ones_are_loaded_once(
    tmp_path: Path,
) -> None:
    holder, other = LoraReplica({"sql": "/a/sql"}), LoraReplica(load_delay=0.2)
    async with serve_upstream(holder) as a, serve_upstream(other) as b:
        discovery = fleet(tmp_path / "fleet.json", [a, b], {"sql": "/a/sql", "chat": "/a/chat"})
        async with serve_router(FAST, discovery) as (router, url), httpx.AsyncClient() as client:
            await async_wait_until(lambda: holding(router), "the holder listed")
            answers = await asyncio.gather(*(ask(client, url, "sql", f"p{i}") for i in range(12)))
            assert [r.status_code for r in answers] == [200] * 12
            assert holder.served == ["sql"] * 12 and other.served == []
            assert holder.loads == other.loads == []
            assert {r.json()["model"] for r in answers} == {"sql"}

            # Held nowhere: loaded once, on the least loaded replica, for all who asked.
            holder.load_delay = 0.2
            answers = await asyncio.gather(*(ask(client, url, "chat", f"q{i}") for i in range(8)))
            assert [r.status_code for r in answers] == [200] * 8, [r.text for r in answers]
            assert sorted(holder.loads + other.loads) == ["chat"]
            loader = holder if holder.loads else other
            assert loader.served.count("chat") == 8

            # The base model's traffic goes on everywhere.
            answers = await asyncio.gather(*(ask(client, url, BASE, f"r{i}") for i in range(8)))
            assert [r.status_code for r in answers] == [200] * 8
            assert BASE in holder.served and BASE in other.served

            listing = (await client.get(f"{url}/v1/models")).json()["data"]
            assert {(m["id"], m["parent"]) for m in listing} == {
                (BASE, None),
                ("sql", BASE),
                ("chat", BASE),
            }
            missing = await ask(client, url, "nope")
            assert missing.status_code == 404
            assert missing.json()["error"]["message"] == "The model `nope` does not exist."


async def test_a_refused_adapter_gets_404_with_the_reason_and_is_not_retried_at_once(
    tmp_path: Path,
) -> None:
    reason = "Loaded adapter has rank 64, greater than --max-lora-rank 16"
    replicas = [LoraReplica(), LoraReplica()]
    for replica in replicas:
        replica.refuse["/a/bad"] = reason
    async with serve_upstream(replicas[0]) as a, serve_upstream(replicas[1]) as b:
        discovery = fleet(tmp_path / "fleet.json", [a, b], {"bad": "/a/bad", "ok": "/a/ok"})
        async with serve_router(FAST, discovery) as (router, url), httpx.AsyncClient() as client:
            router.pool.loads.backoff = 0.5
            await async_wait_until(lambda: serving(router), "replicas")
            first = await ask(client, url, "bad")
            assert first.status_code == 404
            assert reason in first.json()["error"]["message"]
            assert first.json()["error"]["param"] == "model"
            # Backed off: answered at once with the same reason, no load asked for.
            again = await asyncio.gather(*(ask(client, url, "bad") for _ in range(5)))
            assert {r.status_code for r in again} == {404}
            assert all(reason in r.json()["error"]["message"] for r in again)
            assert sum(len(r.loads) for r in replicas) == 1
            # Other adapters and the model are served meanwhile.
            assert (await ask(client, url, "ok")).status_code == 200
            assert (await ask(client, url, BASE)).status_code == 200
            # After the backoff, one more try (and a longer backoff after it).
            await asyncio.sleep(0.6)
            assert (await ask(client, url, "bad")).status_code == 404
            assert [n for r in replicas for n in r.loads].count("bad") == 2
            assert (await ask(client, url, "bad")).status_code == 404
            assert [n for r in replicas for n in r.loads].count("bad") == 2


async def test_loads_in_flight_are_bounded(tmp_path: Path) -> None:
    replica = LoraReplica(load_delay=0.3)
    names = [f"a{i}" for i in range(6)]
    async with serve_upstream(replica) as a:
        discovery = fleet(tmp_path / "fleet.json", [a], {n: f"/a/{n}" for n in names})
        async with serve_router(FAST, discovery) as (router, url), httpx.AsyncClient() as client:
            router.pool.loads.max_loads = 2
            await async_wait_until(lambda: serving(router), "a replica")
            answers = await asyncio.gather(*(ask(client, url, n) for n in names))
            assert [r.status_code for r in answers] == [200] * 6
            assert sorted(replica.loads) == names
            assert replica.most_loading == 2


async def test_a_replica_that_lost_its_adapter_gets_it_again(tmp_path: Path) -> None:
    replica = LoraReplica({"sql": "/a/sql"})
    async with serve_upstream(replica) as a:
        discovery = fleet(tmp_path / "fleet.json", [a], {"sql": "/a/sql"})
        settings = RouterSettings(scrape_interval=60)  # no listing between the two requests
        async with (
            serve_router(settings, discovery) as (router, url),
            httpx.AsyncClient() as client,
        ):
            await async_wait_until(lambda: holding(router), "the holder listed")
            assert (await ask(client, url, "sql")).status_code == 200
            replica.holds.clear()  # it restarted: it holds nothing
            answer = await ask(client, url, "sql")
            assert answer.status_code == 200, answer.text
            assert replica.loads == ["sql"]


async def test_adapters_without_files_or_failed_at_their_source() -> None:
    replica = LoraReplica()
    async with serve_upstream(replica) as a:

        class Fixed(StaticDiscovery):
            def load(self) -> dict[str, ModelRoute]:
                adapters = (
                    AdapterRoute("pulling"),
                    AdapterRoute("broken", error="Job smol-lora-1 failed: no safetensors"),
                )
                return {BASE: ModelRoute(BASE, (ReplicaRef(a),), adapters=adapters)}

        async with serve_router(FAST, Fixed(None)) as (router, url), httpx.AsyncClient() as client:
            await async_wait_until(lambda: serving(router), "a replica")
            pending = await ask(client, url, "pulling")
            assert pending.status_code == 503 and pending.headers["Retry-After"]
            broken = await ask(client, url, "broken")
            assert broken.status_code == 404
            assert "no safetensors" in broken.json()["error"]["message"]
            assert replica.loads == [] and replica.served == []
