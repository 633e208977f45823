"""A replica SIGKILLed under load: of 24 concurrent requests on two replicas, two thirds of
them chat streams, every request that had not received a token completes on the other replica
(streams whose only event so far was the role-only opening included), the streams that had
received tokens end with an error event, and nothing hangs. Then the router marks the replica
down, and up again once it is back."""

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
# The first wave: long chat streams that fill both replicas' running slots and are still
# generating when the victim dies, so that the victim is running streams with tokens at their
# clients, whichever way the load spreads.
FIRST_WAVE = 2 * ALPHA_MAX_SEQS
LONG_TOKENS = 512


async def _one(
    client: httpx.AsyncClient, url: str, i: int, with_tokens: set[int]
) -> dict[str, Any]:
    """The first wave, then plain completions and chat streams in pairs: least load alternates
    between the two replicas, so each gets both kinds. `with_tokens` collects the streams
    whose client has received content."""
    headers = {"X-Request-Id": f"burst-{i}"}
    max_tokens = LONG_TOKENS if i < FIRST_WAVE else MAX_TOKENS
    common = {"model": "alpha", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    if i >= FIRST_WAVE and i % 4 >= 2:
        body = {**common, "prompt": f"Request number {i} asks the fleet about"}
        r = await client.post(f"{url}/v1/completions", json=body, headers=headers)
        return {"i": i, "stream": False, "status": r.status_code, "body": r.json()}
    body = {**common, "messages": [{"role": "user", "content": f"Request {i}"}], "stream": True}
    text = ""
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        async for chunk in r.aiter_text():
            text += chunk
            if i not in with_tokens and any(_has_content(b) for b in _blocks(text)):
                with_tokens.add(i)
    return {"i": i, "stream": True, "status": r.status_code, "blocks": _blocks(text)}


def _blocks(text: str) -> list[str]:
    """The complete `data:` blocks of an event stream."""
    return [b[6:] for b in text.split("\n\n")[:-1] if b.startswith("data: ")]


def _has_content(block: str) -> bool:
    if block == "[DONE]":
        return False
    choices = json.loads(block).get("choices") or [{}]
    return bool(choices[0].get("delta", {}).get("content"))


def _running_and_waiting(engine_url: str) -> tuple[float, float]:
    text = httpx.get(f"{engine_url}/metrics", timeout=10).text
    return (
        metric_sum(text, "vllm:num_requests_running"),
        metric_sum(text, "vllm:num_requests_waiting"),
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
    with_tokens: set[int] = set()

    def first_wave_streaming() -> bool:
        # Every request either replica runs has tokens at its client (only the first wave
        # has been sent), and the victim runs some.
        running = [_running_and_waiting(e.url)[0] for e in (survivor, victim)]
        return running[1] >= 1 and len(with_tokens) >= sum(running)

    async def burst() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=GUARD) as client:

            def send(ids: range) -> list[asyncio.Task[dict[str, Any]]]:
                return [asyncio.create_task(_one(client, router.url, i, with_tokens)) for i in ids]

            tasks = send(range(FIRST_WAVE))
            await asyncio.to_thread(wait_until, first_wave_streaming, "first wave", GUARD)
            tasks += send(range(FIRST_WAVE, REQUESTS))
            # Kill while the victim holds requests of the second wave in its queue behind the
            # first wave's streams; the queued streams have had their role-only opening event
            # from it, and no token.
            await asyncio.to_thread(
                wait_until,
                lambda: _running_and_waiting(victim.url)[1] >= ALPHA_MAX_SEQS,
                "victim's queue",
                GUARD,
            )
            victim.kill()
            return await asyncio.wait_for(asyncio.gather(*tasks), GUARD)

    try:
        results = asyncio.run(burst())
        _check_results(results, _request_log(router.log_text()), victim.url)
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


def _check_results(
    results: list[dict[str, Any]], log: dict[str, dict[str, Any]], victim_url: str
) -> None:
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
            assert entry["replica"] == victim_url
            assert any(d.get("content") for d in deltas)
        else:
            assert all("error" not in e for e in events)
            assert events[-1]["choices"][0]["finish_reason"] == "length"
            moved_streams += entry["attempts"] > 1
            # The first wave's streams were still generating at the kill: those the victim
            # ran were cut, so every one that completed ran on the survivor.
            if result["i"] < FIRST_WAVE:
                assert entry["replica"] != victim_url
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
