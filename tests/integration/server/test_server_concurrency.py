"""Concurrent streams stay separate and correct; clients that go away leave nothing behind."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from server_helpers import MAX_MODEL_LEN, SERVED_NAME, ServerProcess, parse_sse, wait_until

from fleetllm.engine.llm import LLM
from fleetllm.engine.sampling_params import SamplingParams

LONG = {"max_tokens": MAX_MODEL_LEN - 64, "ignore_eos": True, "temperature": 0.0}


def test_32_concurrent_streams(server: ServerProcess, offline_llm: LLM) -> None:
    prompts = [f"Request number {i} asks about topic {i * 7}" for i in range(32)]
    params = {"temperature": 0.0, "max_tokens": 20}
    expected = offline_llm.generate(prompts, SamplingParams(**params))

    async def one(client: httpx.AsyncClient, prompt: str) -> list[Any]:
        body = {"model": SERVED_NAME, "prompt": prompt, "stream": True, **params}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            raw = "".join([part async for part in response.aiter_text()])
        return parse_sse(raw)

    async def run() -> list[list[Any]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    streams = asyncio.run(run())
    ids = set()
    for events, want in zip(streams, expected, strict=True):
        stream_ids = {e["id"] for e in events}
        assert len(stream_ids) == 1, "chunks of another request leaked into this stream"
        ids |= stream_ids
        assert all(len(e["choices"]) == 1 and e["choices"][0]["index"] == 0 for e in events)
        text = "".join(e["choices"][0]["text"] for e in events)
        assert text == want.outputs[0].text
        reasons = [e["choices"][0]["finish_reason"] for e in events]
        assert reasons[-1] == want.outputs[0].finish_reason
        assert all(r is None for r in reasons[:-1])
    assert len(ids) == 32


def _idle(server: ServerProcess, idle_kv: float) -> bool:
    m = server.metrics()
    return (
        m[("vllm:num_requests_running", ())] == 0
        and m[("vllm:num_requests_waiting", ())] == 0
        and m[("vllm:kv_cache_usage_perc", ())] == idle_kv
    )


def _aborted(server: ServerProcess) -> float:
    return server.metric("vllm:request_success_total", finished_reason="abort")


def test_disconnect_mid_stream_aborts(server: ServerProcess) -> None:
    wait_until(lambda: server.metric("vllm:num_requests_running") == 0, what="idle server")
    idle_kv = server.metric("vllm:kv_cache_usage_perc")
    aborted = _aborted(server)
    body = {"model": SERVED_NAME, "prompt": "Stream me a long text", "stream": True, **LONG}
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json=body, timeout=60
    ) as response:
        lines = response.iter_lines()
        while '"text":""' in (line := next(lines)) or not line.startswith("data: "):
            pass
        assert server.metric("vllm:num_requests_running") == 1
        assert server.metric("vllm:kv_cache_usage_perc") > idle_kv
    # Leaving the block closes the connection mid-stream.
    took = wait_until(lambda: _idle(server, idle_kv), what="request gone after disconnect")
    print(f"the aborted request was gone {took:.3f}s after the disconnect")
    assert _aborted(server) == aborted + 1


def test_disconnect_while_waiting_for_whole_response(server: ServerProcess) -> None:
    wait_until(lambda: server.metric("vllm:num_requests_running") == 0, what="idle server")
    idle_kv = server.metric("vllm:kv_cache_usage_perc")
    aborted = _aborted(server)
    body = {"model": SERVED_NAME, "prompt": "A long answer please", **LONG}
    seen_running = False

    def running() -> bool:
        nonlocal seen_running
        seen_running = server.metric("vllm:num_requests_running") == 1
        return seen_running

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            task = asyncio.create_task(client.post("/v1/completions", json=body))
            await asyncio.to_thread(wait_until, running, 30.0, "request running")
            task.cancel()  # drops the connection before the response
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(run())
    assert seen_running
    wait_until(lambda: _idle(server, idle_kv), what="request gone after disconnect")
    assert _aborted(server) == aborted + 1


def test_50_disconnects_leak_nothing(server: ServerProcess) -> None:
    wait_until(lambda: server.metric("vllm:num_requests_running") == 0, what="idle server")
    idle_kv = server.metric("vllm:kv_cache_usage_perc")
    aborted = _aborted(server)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        chat = i % 2 == 1
        body: dict[str, Any] = {"model": SERVED_NAME, "stream": True, **LONG}
        if chat:
            body["messages"] = [{"role": "user", "content": f"Question {i}"}]
        else:
            body["prompt"] = f"Prompt {i} is about"
        path = "/v1/chat/completions" if chat else "/v1/completions"
        async with client.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            if i % 5 == 0:
                return  # gone right after the headers, before any token
            tokens = 0
            async for line in response.aiter_lines():
                if line.startswith("data: ") and ('"text":"' in line or '"content":"' in line):
                    tokens += 1
                    if tokens >= 2 + i % 3:
                        return

    async def run() -> None:
        # Ten at a time, each on its own connection, so disconnects overlap with admissions.
        async with httpx.AsyncClient(
            base_url=server.base_url, timeout=60, limits=httpx.Limits(max_keepalive_connections=0)
        ) as client:
            for start in range(0, 50, 10):
                await asyncio.gather(*(one(client, i) for i in range(start, start + 10)))

    asyncio.run(run())
    wait_until(lambda: _idle(server, idle_kv), what="all 50 requests gone")
    assert _aborted(server) == aborted + 50
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    # And it still serves a full-length request.
    response = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": SERVED_NAME, "prompt": "After the storm", **LONG},
        timeout=120,
    )
    assert response.status_code == 200
    assert response.json()["choices"][0]["finish_reason"] == "length"
