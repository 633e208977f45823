"""Acceptance 4 with static discovery: requests for a model with no replica wait, a demand
signal goes out, and they complete once a replica registers; past the queue bound or the
timeout they get 503 with Retry-After."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_testkit import Process, metric_sum, wait_until, write_fleet

GUARD = 180.0


class _Webhook:
    """Receives the router's demand signals."""

    def __init__(self) -> None:
        self.received: list[Any] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                outer.received.append(json.loads(self.rfile.read(length)))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/demand"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def webhook() -> Iterator[_Webhook]:
    hook = _Webhook()
    yield hook
    hook.close()


def _held(router: Process, model: str) -> float:
    return metric_sum(router.metrics_text(), "fleetllm:router_held_requests", model=model)


def _body(i: int) -> dict[str, Any]:
    return {
        "model": "gamma",
        "messages": [{"role": "user", "content": f"Wake up, number {i}."}],
        "max_tokens": 6,
        "temperature": 0,
    }


async def _request(client: httpx.AsyncClient, url: str, i: int) -> tuple[int, str]:
    body = _body(i)
    if i % 2:
        r = await client.post(f"{url}/v1/chat/completions", json=body)
        return r.status_code, r.json()["choices"][0]["message"]["content"]
    async with client.stream(
        "POST", f"{url}/v1/chat/completions", json={**body, "stream": True}
    ) as r:
        text = (await r.aread()).decode()
    assert text.endswith("data: [DONE]\n\n")
    events = [json.loads(b[6:]) for b in text.split("\n\n")[:-2] if b.startswith("data: ")]
    return r.status_code, "".join(e["choices"][0]["delta"].get("content", "") for e in events)


def test_held_requests_complete_once_a_replica_registers(
    gamma_engine: Callable[[], Process], start_router: Any, webhook: _Webhook, tmp_path: Path
) -> None:
    fleet_file = tmp_path / "fleet.json"
    write_fleet(fleet_file, {"gamma": []})
    router = start_router(
        "--fleet-file", str(fleet_file), "--hold-timeout", str(GUARD),
        "--demand-webhook", webhook.url,
    )  # fmt: skip

    async def scenario() -> list[tuple[int, str]]:
        async with httpx.AsyncClient(timeout=GUARD) as client:
            tasks = [asyncio.create_task(_request(client, router.url, i)) for i in range(6)]
            await asyncio.to_thread(
                wait_until, lambda: _held(router, "gamma") == 6, "6 requests held", GUARD
            )
            assert not any(t.done() for t in tasks)
            # The supervisor (here: the test) answers the demand signal with a replica.
            await asyncio.to_thread(
                wait_until, lambda: {"model": "gamma"} in webhook.received, "demand", GUARD
            )
            engine = await asyncio.to_thread(gamma_engine)
            write_fleet(fleet_file, {"gamma": [engine.url]})
            return await asyncio.wait_for(asyncio.gather(*tasks), GUARD)

    results = asyncio.run(scenario())
    assert [status for status, _ in results] == [200] * 6
    engine = gamma_engine()
    for i, (_, content) in enumerate(results):
        direct = httpx.post(f"{engine.url}/v1/chat/completions", json=_body(i), timeout=GUARD)
        assert content == direct.json()["choices"][0]["message"]["content"]
    metrics = router.metrics_text()
    assert metric_sum(metrics, "fleetllm:router_queue_time_seconds_count", model="gamma") == 6
    assert metric_sum(metrics, "fleetllm:router_queue_time_seconds_sum", model="gamma") > 0
    assert metric_sum(metrics, "fleetllm:router_demand_signals_total", model="gamma") >= 1
    assert _held(router, "gamma") == 0


def test_past_the_queue_bound_or_the_timeout_requests_get_503_with_retry_after(
    start_router: Any, webhook: _Webhook, tmp_path: Path
) -> None:
    fleet_file = tmp_path / "fleet.json"
    write_fleet(fleet_file, {"cold": []})
    router = start_router(
        "--fleet-file", str(fleet_file), "--hold-queue-size", "2", "--hold-timeout", "1",
        "--demand-webhook", webhook.url,
    )  # fmt: skip

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=GUARD) as client:
            body = {"model": "cold", "prompt": "x"}
            first = [
                asyncio.create_task(client.post(f"{router.url}/v1/completions", json=body))
                for _ in range(2)
            ]
            await asyncio.to_thread(
                wait_until, lambda: _held(router, "cold") == 2, "queue full", GUARD
            )
            overflow = await client.post(f"{router.url}/v1/completions", json=body)
            return [overflow, *await asyncio.gather(*first)]

    overflow, *timed_out = asyncio.run(scenario())
    for r, why in [(overflow, "is full"), *((t, "timed out") for t in timed_out)]:
        assert r.status_code == 503
        assert r.headers["Retry-After"].isdigit()
        error = r.json()["error"]
        assert error["type"] == "ServiceUnavailableError" and why in error["message"]
    wait_until(lambda: {"model": "cold"} in webhook.received, "demand signal", GUARD)
