"""What one client can take from the router: connections that send their headers or body too
slowly are cut off, held requests are bounded in bytes, a key's token budget is charged for
streams it abandons and its requests open at once are capped; and what the router keeps of
replicas that left: no metric series, ever again, and no URLs with credentials."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from aiohttp import web
from router_testkit import async_wait_until, metric_samples, serve_router, serve_upstream

from fleetllm.router.config import RouterSettings
from fleetllm.router.discovery import ModelRoute, ReplicaRef, parse_static_fleet

pytestmark = pytest.mark.asyncio

GUARD = 30.0  # hang guard only
EVENT = b'data: {"choices":[{"index":0,"text":"x"}]}\n\n'


class Gate:
    """A replica that answers once `open` is set, and streams until the client leaves."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.arrived = 0

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        if request.path in ("/health", "/metrics"):
            return web.Response(text="")
        body = await request.json()
        self.arrived += 1
        await self.open.wait()
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "x"}], "usage": {"total_tokens": 1}})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        while True:
            await response.write(EVENT)
            await asyncio.sleep(0.01)


def _fleet(*urls: str) -> dict[str, ModelRoute]:
    return parse_static_fleet({"models": {"m": list(urls)}})


async def test_a_client_that_sends_its_headers_too_slowly_is_cut_off() -> None:
    settings = RouterSettings(client_header_timeout=0.3)
    async with serve_router(settings) as (_, url):
        port = int(url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        await writer.drain()
        # No more bytes: the router closes the connection (an empty read is its EOF).
        assert await asyncio.wait_for(reader.read(), GUARD) == b""
        writer.close()
        # A timely client is served as before.
        async with httpx.AsyncClient(timeout=GUARD) as client:
            assert (await client.get(f"{url}/health")).status_code == 200


async def test_a_body_that_does_not_arrive_in_time_is_answered_408() -> None:
    gate = Gate()
    gate.open.set()
    settings = RouterSettings(client_body_timeout=0.3)
    async with serve_upstream(gate) as up, serve_router(settings) as (router, url):
        router.apply_fleet(_fleet(up))
        port = int(url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model": "m"'
        )
        await writer.drain()
        # The answer, and then the connection closes: the rest of the body is not awaited.
        answer = await asyncio.wait_for(reader.read(), GUARD)
        writer.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408")
        assert b'"code":408' in body and b"RequestTimeoutError" in body
        assert gate.arrived == 0


async def test_held_requests_are_bounded_in_bytes_too() -> None:
    settings = RouterSettings(hold_queue_size=100, hold_queue_bytes=1500, hold_timeout=1.0)
    async with serve_router(settings) as (router, url), httpx.AsyncClient(timeout=GUARD) as c:
        router.apply_fleet(parse_static_fleet({"models": {"cold": []}}))
        body = {"model": "cold", "prompt": "x" * 1000}
        first = asyncio.create_task(c.post(f"{url}/v1/completions", json=body))
        await async_wait_until(lambda: len(router.models["cold"].hold) == 1, "first held")
        second = await c.post(f"{url}/v1/completions", json=body)
        assert second.status_code == 503 and "is full" in second.json()["error"]["message"]
        # Small requests still fit beside the big one.
        small = await c.post(f"{url}/v1/completions", json={"model": "cold", "prompt": "x"})
        assert small.status_code == 503 and "timed out" in small.json()["error"]["message"]
        assert (await first).status_code == 503
        assert router.models["cold"].hold.bytes == 0


async def test_a_stream_the_client_abandons_is_charged_to_its_key(tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  - {name: k, key: sk-k, tokensPerMinute: 30}\n")
    gate = Gate()
    gate.open.set()
    auth = {"Authorization": "Bearer sk-k"}
    body = {"model": "m", "prompt": "x", "stream": True}
    async with (
        serve_upstream(gate) as up,
        serve_router(RouterSettings(), keys_file=keys) as (router, url),
        httpx.AsyncClient(timeout=GUARD) as client,
    ):
        router.apply_fleet(_fleet(up))
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=auth) as r:
            assert r.status_code == 200
            seen = 0
            async for chunk in r.aiter_bytes():
                seen += chunk.count(b"data: ")
                if seen >= 40:
                    break  # the client leaves mid-stream, well past its 30 tokens a minute
        replica = router.models["m"].replicas[up].replica
        await async_wait_until(lambda: replica.in_flight == 0, "the stream closed")
        assert router.access.open == {}
        again = await client.post(f"{url}/v1/completions", json=body, headers=auth)
        assert again.status_code == 429 and again.json()["error"]["type"] == "RateLimitError"
        assert gate.arrived == 1


async def test_a_keys_requests_open_at_once_are_capped(tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        "keys:\n  - {name: capped, key: sk-c, maxConcurrentRequests: 2}\n"
        "  - {name: other, key: sk-o}\n"
    )
    gate = Gate()
    body = {"model": "m", "prompt": "x"}

    def auth(key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    async with (
        serve_upstream(gate) as up,
        serve_router(RouterSettings(), keys_file=keys) as (router, url),
        httpx.AsyncClient(timeout=GUARD) as client,
    ):
        router.apply_fleet(_fleet(up))
        post = f"{url}/v1/completions"
        open_two = [
            asyncio.create_task(client.post(post, json=body, headers=auth("sk-c")))
            for _ in range(2)
        ]
        await async_wait_until(lambda: gate.arrived == 2, "two requests at the replica")
        third = await client.post(post, json=body, headers=auth("sk-c"))
        assert third.status_code == 429 and third.headers["Retry-After"] == "1"
        assert "2 requests open" in third.json()["error"]["message"]
        other = asyncio.create_task(client.post(post, json=body, headers=auth("sk-o")))
        await async_wait_until(lambda: gate.arrived == 3, "another key is not capped")
        gate.open.set()
        assert [r.status_code for r in await asyncio.gather(*open_two, other)] == [200] * 3
        assert router.access.open == {}
        again = await client.post(post, json=body, headers=auth("sk-c"))
        assert again.status_code == 200


async def test_the_series_of_a_removed_replica_never_come_back() -> None:
    leaving, staying = Gate(), Gate()
    staying.open.set()
    async with (
        serve_upstream(leaving) as gone_url,
        serve_upstream(staying) as stay_url,
        serve_router(RouterSettings(strategy="round-robin", scrape_interval=0.05)) as (
            router,
            url,
        ),
        httpx.AsyncClient(timeout=GUARD) as client,
    ):
        router.apply_fleet(_fleet(gone_url, stay_url))
        router.models["m"].turn = 0
        body = {"model": "m", "prompt": "x"}
        in_flight = asyncio.create_task(client.post(f"{url}/v1/completions", json=body))
        await async_wait_until(lambda: leaving.arrived == 1, "a request on the leaving replica")

        def series(replica: str) -> list[str]:
            text = router.metrics.render().decode()
            return [name for name, labels in metric_samples(text) if ("replica", replica) in labels]

        assert {"fleetllm:router_inflight", "fleetllm:router_replica_up"} <= set(series(gone_url))
        router.apply_fleet(_fleet(stay_url))
        assert series(gone_url) == []
        leaving.open.set()  # its last answer comes after it left
        assert (await in_flight).status_code == 200
        assert (await client.post(f"{url}/v1/completions", json=body)).status_code == 200
        await asyncio.sleep(0.2)  # several scrape intervals
        assert series(gone_url) == []
        assert series(stay_url)


async def test_replica_urls_with_credentials_are_refused() -> None:
    async with (
        serve_router(RouterSettings(), admin_key="admin") as (router, url),
        httpx.AsyncClient(timeout=GUARD) as client,
    ):
        doc = {"models": {"m": ["http://user:hunter2@127.0.0.1:9"]}}
        r = await client.put(
            f"{url}/admin/fleet", json=doc, headers={"Authorization": "Bearer admin"}
        )
        assert r.status_code == 400 and "credentials" in r.json()["error"]["message"]
        assert "hunter2" not in r.text and "m" not in router.models
        # Whatever the source, such a replica never enters the pool.
        secret = ReplicaRef("http://user:hunter2@127.0.0.1:9")
        plain = ReplicaRef("http://127.0.0.1:9")
        router.apply_fleet({"m": ModelRoute("m", (secret, plain))})
        assert list(router.models["m"].replicas) == [plain.url]
        assert "hunter2" not in router.metrics.render().decode()


async def test_a_fault_of_the_routers_own_is_a_500_envelope_and_the_router_goes_on() -> None:
    gate = Gate()
    gate.open.set()
    async with (
        serve_upstream(gate) as up,
        serve_router(RouterSettings()) as (router, url),
        httpx.AsyncClient(timeout=GUARD) as client,
    ):
        router.apply_fleet(_fleet(up))
        order = router.pool.order

        def broken(*args: object) -> object:
            raise RuntimeError("a bug")

        router.pool.order = broken  # type: ignore[method-assign]
        r = await client.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"
        assert "a bug" not in r.text
        text = router.metrics.render().decode()
        assert (
            metric_samples(text)[
                ("fleetllm:router_requests_total", (("code", "500"), ("model", "m")))
            ]
            == 1
        )
        router.pool.order = order  # type: ignore[method-assign]
        r = await client.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 200
