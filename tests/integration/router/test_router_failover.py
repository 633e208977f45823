"""A replica SIGKILLed under load: of 24 concurrent requests on two replicas, half of them chat
streams, every request that had not received a token completes on the other replica (streams
whose only event so far was the role-only opening included), the streams that had received
tokens end with an error event, and nothing hangs. Then the router marks the replica down, and
up again once it is back."""

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
REQUESTS = 24


async def _one(client: httpx.AsyncClient, url: str, i: int) -> dict[str, Any]:
    """Half chat streams, half plain completions, in pairs: least load alternates between
    the two replicas, so each gets both kinds, in every wave it runs."""
    headers = {"X-Request-Id": f"burst-{i}"}
    common = {"model": "alpha", "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
    if i % 4 >= 2:
        body = {**common, "prompt": f"Request number {i} asks the fleet about"}
        r = await client.post(f"{url}/v1/completions", json=body, headers=headers)
        return {"i": i, "stream": False, "status": r.status_code, "body": r.json()}
    body = {**common, "messages": [{"role": "user", "content": f"Request {i}"}], "stream": True}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        text = (await r.aread()).decode()
    blocks = [b[6:] for b in text.split("\n\n") if b.startswith("data: ")]
    return {"i": i, "stream": True, "status": r.status_code, "blocks": blocks}


def _running_with_a_queue(engine_url: str) -> bool:
    text = httpx.get(f"{engine_url}/metrics", timeout=10).text
    return (
        metric_sum(text, "vllm:num_requests_running") >= 1
        and metric_sum(text, "vllm:num_requests_waiting") >= 1
        # Several tokens per running request: the running streams have tokens at their clients.
        and metric_sum(text, "vllm:generation_tokens_total") >= 3 * ALPHA_MAX_SEQS
    )


def test_killing_a_replica_under_load(
    engines: EngineFleet, start_router: Any, tmp_path: Path
) -> None:
    survivor, victim = engines.alpha[0], engines.alpha[1]
    fleet_file = tmp_path / "fleet.json"
    write_fleet(fleet_file, {"alpha": [survivor.url, victim.url]})
    router = start_router(
        "--fleet-file", str(fleet_file), "--strategy", "least-load", "--backoff-max", "2"
    )

    async def burst() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=GUARD) as client:
            tasks = [asyncio.create_task(_one(client, router.url, i)) for i in range(REQUESTS)]
            # Kill while the victim generates for some requests and holds others in its queue
            # (it runs at most ALPHA_MAX_SEQS at a time); the queued streams have had their
            # role-only opening event from it, and no token.
            await asyncio.to_thread(
                wait_until, lambda: _running_with_a_queue(victim.url), "victim busy", GUARD
            )
            victim.kill()
            return await asyncio.wait_for(asyncio.gather(*tasks), GUARD)

    try:
        results = asyncio.run(burst())
        _check_results(results, _request_log(router.log_text()))
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


def _request_log(text: str) -> dict[str, dict[str, Any]]:
    """The router's request log lines, by request id."""
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    return {line["id"]: line for line in lines if line.get("msg") == "request"}


def _check_results(results: list[dict[str, Any]], log: dict[str, dict[str, Any]]) -> None:
    cut_streams = moved_streams = 0
    for result in results:
        assert result["status"] == 200
        entry = log[f"burst-{result['i']}"]
        if not result["stream"]:
            assert result["body"]["usage"]["completion_tokens"] == MAX_TOKENS
            continue
        blocks = result["blocks"]
        assert blocks[-1] == "[DONE]"
        events = [json.loads(b) for b in blocks[:-1]]
        deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
        # Exactly one role-only opening: a dead replica's opening never reaches the client.
        assert sum("role" in d for d in deltas) == 1 and "role" in deltas[0]
        if "error" in events[-1]:
            # Cut after its first token: tokens came first, then the error event, [DONE].
            cut_streams += 1
            assert events[-1]["error"]["code"] == 502 and entry["stream_error"]
            assert any(d.get("content") for d in deltas)
        else:
            assert all("error" not in e for e in events)
            assert events[-1]["choices"][0]["finish_reason"] == "length"
            moved_streams += entry["attempts"] > 1
    # Only streams the victim was running had tokens at their clients; the streams it held
    # in its queue, which had had their opening event from it, moved and completed.
    assert 1 <= cut_streams <= ALPHA_MAX_SEQS
    assert moved_streams >= 1


def _check_router_after_the_kill(router: Any, victim_url: str) -> None:
    metrics = router.metrics_text()
    assert metric_sum(metrics, "fleetllm:router_upstream_retries_total", model="alpha") >= 1
    ok = metric_sum(metrics, "fleetllm:router_requests_total", model="alpha", code="200")
    assert ok == REQUESTS
    # Marked down: by the failed requests at once, and by its failing health checks.
    up = metric_sum(metrics, "fleetllm:router_replica_up", model="alpha", replica=victim_url)
    assert up == 0


@pytest.fixture(autouse=True)
def _victim_is_back(engines: EngineFleet) -> Any:
    """Later tests share these engines: leave every replica healthy."""
    yield
    for p in engines.alpha:
        p.wait_healthy()
