"""What all clients together may make the router hold: requests open at once and the bytes of
their bodies are capped across keys; past either, 503 with Retry-After, before the body is
read, and the budget comes back as requests end."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from router_testkit import async_wait_until, serve_router, serve_upstream
from test_router_limits import Gate, _fleet

from fleetllm.router.config import RouterSettings

pytestmark = pytest.mark.asyncio

GUARD = 30.0  # hang guard only
MiB = 1 << 20


async def _fill(settings: RouterSettings, bodies: list[dict[str, str]]) -> httpx.Response:
    """`bodies` fill the budget (held at the replica); one more like the last is refused:
    that answer."""
    gate = Gate()
    async with (
        serve_upstream(gate) as up,
        serve_router(settings) as (router, url),
        httpx.AsyncClient(timeout=GUARD) as client,
    ):
        router.apply_fleet(_fleet(up))
        held = [asyncio.create_task(client.post(f"{url}/v1/completions", json=b)) for b in bodies]
        await async_wait_until(lambda: gate.arrived == len(bodies), "the first requests held")
        over = await client.post(f"{url}/v1/completions", json=bodies[-1])
        assert over.status_code == 503
        assert over.json()["error"]["code"] == 503
        assert int(over.headers["Retry-After"]) >= 1
        assert gate.arrived == len(bodies)  # never reached a replica
        gate.open.set()
        assert [r.status_code for r in await asyncio.gather(*held)] == [200] * len(bodies)
        assert router.proxy.inflight.requests == 0 and router.proxy.inflight.bytes == 0
        again = await client.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"})
        assert again.status_code == 200
    return over


async def test_requests_in_flight_are_capped_for_all_keys_together() -> None:
    over = await _fill(RouterSettings(max_inflight_requests=3), [{"model": "m", "prompt": "x"}] * 3)
    assert over.status_code == 503 and "at capacity" in over.json()["error"]["message"]


async def test_body_bytes_in_flight_are_capped_for_all_keys_together() -> None:
    settings = RouterSettings(max_body_bytes=MiB, max_inflight_bytes=2 * MiB)
    big = {"model": "m", "prompt": "x" * (MiB - 100)}
    over = await _fill(settings, [big, big])
    assert over.status_code == 503 and "at capacity" in over.json()["error"]["message"]
