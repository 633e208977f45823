"""200 streamed requests through the router, each client leaving mid-stream: every engine goes
back to no running or waiting request and its idle KV-cache usage, and the router's in-flight
gauges go back to 0."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
from router_testkit import EngineFleet, metric_sum, wait_until, write_fleet

GUARD = 120.0  # hang guard only
REQUESTS = 200
CONCURRENCY = 16


def _kv_usage(engine: Any) -> float:
    return metric_sum(engine.metrics_text(), "vllm:kv_cache_usage_perc")


async def _leave_mid_stream(client: httpx.AsyncClient, url: str, i: int) -> int:
    """Stream until the first event with a token, then close the connection."""
    if i % 2:
        path, body = "/v1/completions", {"prompt": f"Story {i}: once upon a time"}
    else:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"{i}"}]}
    body = {**body, "model": "alpha", "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with client.stream("POST", f"{url}{path}", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            if choice.get("text") or choice.get("delta", {}).get("content"):
                return 1  # leaving: the connection closes as the block ends
    return 0  # finished before a token came (it cannot with ignore_eos and 200 tokens)


def test_clients_leaving_mid_stream_leave_nothing_behind(
    engines: EngineFleet, start_router: Any, tmp_path: Path
) -> None:
    fleet_file = tmp_path / "fleet.json"
    write_fleet(fleet_file, {"alpha": [p.url for p in engines.alpha]})
    router = start_router("--fleet-file", str(fleet_file), "--strategy", "least-load")
    for p in engines.alpha:
        wait_until(
            lambda p=p: metric_sum(p.metrics_text(), "vllm:num_requests_running") == 0,
            "idle before",
            GUARD,
        )
    idle_usage = {p.url: _kv_usage(p) for p in engines.alpha}

    async def clients() -> list[int]:
        gate = asyncio.Semaphore(CONCURRENCY)

        async def one(client: httpx.AsyncClient, i: int) -> int:
            async with gate:
                return await _leave_mid_stream(client, router.url, i)

        async with httpx.AsyncClient(timeout=GUARD) as client:
            return await asyncio.wait_for(
                asyncio.gather(*(one(client, i) for i in range(REQUESTS))), GUARD
            )

    assert sum(asyncio.run(clients())) == REQUESTS  # every client left after a token

    def engines_idle() -> bool:
        for p in engines.alpha:
            text = p.metrics_text()
            if (
                metric_sum(text, "vllm:num_requests_running") != 0
                or metric_sum(text, "vllm:num_requests_waiting") != 0
                or metric_sum(text, "vllm:kv_cache_usage_perc") != idle_usage[p.url]
            ):
                return False
        return True

    wait_until(engines_idle, "every engine idle, with its idle KV usage", GUARD)

    def router_idle() -> bool:
        metrics = router.metrics_text()
        return metric_sum(metrics, "fleetllm:router_inflight", model="alpha") == 0

    wait_until(router_idle, "the router's in-flight gauges at 0", GUARD)
    metrics = router.metrics_text()
    for p in engines.alpha:
        assert metric_sum(metrics, "fleetllm:router_inflight", replica=p.url) == 0
        assert metric_sum(metrics, "fleetllm:router_replica_up", replica=p.url) == 1
    # Each request was answered, or counted as left by its client; none failed.
    left = metric_sum(metrics, "fleetllm:router_requests_total", model="alpha", code="499")
    done = metric_sum(metrics, "fleetllm:router_requests_total", model="alpha", code="200")
    assert left + done == REQUESTS and left >= 1
    # And the engines still serve.
    r = httpx.post(
        f"{router.url}/v1/completions",
        json={"model": "alpha", "prompt": "after", "max_tokens": 3, "ignore_eos": True},
        timeout=GUARD,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
