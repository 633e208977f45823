"""Acceptance 3: a replica killed under 50 concurrent requests. Requests that had received
nothing complete on the other replicas; streams cut on the killed one end with an error event;
the router marks the replica down, and up again once it is back."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_testkit import ALPHA_MAX_SEQS, EngineFleet, metric_sum, wait_until, write_fleet

GUARD = 180.0  # hang guard for the whole burst
MAX_TOKENS = 64
# The first requests stream, the rest do not: each replica admits its first (streaming)
# arrivals while the later ones, of both kinds, wait in its queue.
STREAMS = 30


async def _one(client: httpx.AsyncClient, url: str, i: int) -> dict[str, Any]:
    body = {
        "model": "alpha",
        "prompt": f"Request number {i} asks the fleet about",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
    }
    if i >= STREAMS:
        r = await client.post(f"{url}/v1/completions", json=body)
        return {"stream": False, "status": r.status_code, "body": r.json()}
    async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        text = (await r.aread()).decode()
    blocks = [b[6:] for b in text.split("\n\n") if b.startswith("data: ")]
    return {"stream": True, "status": r.status_code, "blocks": blocks}


def _running_with_a_queue(engine_url: str) -> bool:
    text = httpx.get(f"{engine_url}/metrics", timeout=10).text
    return (
        metric_sum(text, "vllm:num_requests_running") >= 1
        and metric_sum(text, "vllm:num_requests_waiting") >= 1
        # Several tokens per running stream: their first events have reached the clients.
        and metric_sum(text, "vllm:generation_tokens_total") >= 3 * ALPHA_MAX_SEQS
    )


def test_killing_a_replica_under_load(
    engines: EngineFleet, start_router: Any, tmp_path: Path
) -> None:
    fleet_file = tmp_path / "fleet.json"
    write_fleet(fleet_file, {"alpha": [p.url for p in engines.alpha]})
    router = start_router(
        "--fleet-file", str(fleet_file), "--strategy", "least-load", "--backoff-max", "2"
    )
    victim = engines.alpha[1]

    async def burst() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=GUARD) as client:
            tasks = [asyncio.create_task(_one(client, router.url, i)) for i in range(50)]
            # Kill while the victim is generating for some streams and still has requests
            # waiting in its queue (it runs at most ALPHA_MAX_SEQS at a time).
            await asyncio.to_thread(
                wait_until, lambda: _running_with_a_queue(victim.url), "victim busy", GUARD
            )
            victim.kill()
            return await asyncio.wait_for(asyncio.gather(*tasks), GUARD)

    try:
        results = asyncio.run(burst())
        _check_results(results)
        _check_router_after_the_kill(router, victim.url)
    finally:
        if victim.proc.poll() is not None:
            victim.restart()

    def replica_up() -> float:
        text = router.metrics_text()
        return metric_sum(text, "fleetllm:router_replica_up", model="alpha", replica=victim.url)

    # Restarted on the same address; once healthy it is up and takes requests again.
    victim.wait_healthy()
    wait_until(lambda: replica_up() == 1, "restarted replica marked up", GUARD)

    def served_by_victim() -> float:
        return metric_sum(
            router.metrics_text(),
            "fleetllm:router_upstream_requests_total",
            replica=victim.url,
            code="200",
        )

    before = served_by_victim()
    for i in range(6):
        r = httpx.post(
            f"{router.url}/v1/completions",
            json={"model": "alpha", "prompt": f"again {i}", "max_tokens": 2},
            timeout=GUARD,
        )
        assert r.status_code == 200
    assert served_by_victim() > before


def _check_results(results: list[dict[str, Any]]) -> None:
    cut_streams = 0
    for result in results:
        assert result["status"] == 200
        if not result["stream"]:
            usage = result["body"]["usage"]
            assert usage["completion_tokens"] == MAX_TOKENS
            continue
        blocks = result["blocks"]
        assert blocks[-1] == "[DONE]"
        events = [json.loads(b) for b in blocks[:-1]]
        if "error" in events[-1]:
            # Cut after it had started: data came first, then the error event, then [DONE].
            cut_streams += 1
            assert events[-1]["error"]["code"] == 502
            assert len(events) >= 2 and all("choices" in e for e in events[:-1])
        else:
            assert all("error" not in e for e in events)
            assert events[-1]["choices"][0]["finish_reason"] == "length"
    # Only streams the victim was running had received bytes; everything it held in its
    # queue, or was answering without streaming, went elsewhere and completed.
    assert 1 <= cut_streams <= ALPHA_MAX_SEQS


def _check_router_after_the_kill(router: Any, victim_url: str) -> None:
    metrics = router.metrics_text()
    assert metric_sum(metrics, "fleetllm:router_upstream_retries_total", model="alpha") >= 1
    assert metric_sum(metrics, "fleetllm:router_requests_total", model="alpha", code="200") == 50
    # Marked down: by the failed requests at once, and by its failing health checks.
    up = metric_sum(metrics, "fleetllm:router_replica_up", model="alpha", replica=victim_url)
    assert up == 0


@pytest.fixture(autouse=True)
def _victim_is_back(engines: EngineFleet) -> Any:
    """Later tests share these engines: leave every replica healthy."""
    yield
    for p in engines.alpha:
        p.wait_healthy()
