"""In process: a request that fails inside the engine answers 500 (or ends its stream with an
error event) while the requests beside it finish and /health stays 200; a step that hangs
turns /health into 503 until it ends; the per-request work caps and the waiting bound refuse
what they should; large prompts and chat templates are handled off the event loop."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import SERVED_NAME, parse_sse

from fleetllm.engine.async_engine import AsyncEngine
from fleetllm.engine.config import EngineConfig
from fleetllm.engine.engine import LLMEngine
from fleetllm.engine.server import ServerSettings, create_app

POISON = 13  # a prompt starting with this token id gets the injected fault
HANG_GUARD_S = 60.0

Fault = Callable[[list[Any]], None]


def _factory(model_dir: Path, fault: Fault | None = None) -> Callable[[], LLMEngine]:
    def make() -> LLMEngine:
        engine = LLMEngine(
            EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64, max_model_len=256)
        )
        if fault is not None:
            real_execute = engine.executor.execute

            def execute(step: Any) -> Any:
                fault([engine.requests[r] for r in step.request_ids if r in engine.requests])
                return real_execute(step)

            engine.executor.execute = execute  # type: ignore[method-assign]
        return engine

    return make


def _poisoned(batch: list[Any]) -> list[Any]:
    return [r for r in batch if r.prompt_token_ids[0] == POISON]


async def _started(
    factory: Callable[[], LLMEngine], **settings: Any
) -> tuple[httpx.AsyncClient, AsyncEngine]:
    waiting = settings.pop("max_waiting_requests", None)
    app = create_app(
        ServerSettings(model_names=[SERVED_NAME], **settings),
        factory,
        max_waiting_requests=waiting,
    )
    engine: AsyncEngine = app.state.server.engine
    engine.start()
    await asyncio.wait_for(engine.wait_loaded(), HANG_GUARD_S)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine")
    return client, engine


def _completion(prompt: Any, max_tokens: int, **fields: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **fields}


async def _assert_idle_and_serving(client: httpx.AsyncClient, engine: AsyncEngine) -> None:
    assert (await client.get("/health")).status_code == 200
    ok = await client.post("/v1/completions", json=_completion("hello", 3))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    stats = engine.stats
    assert stats is not None
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0


@pytest.mark.asyncio
async def test_a_request_failing_in_a_step_fails_alone(tiny_chat_dir: Path) -> None:
    def fault(batch: list[Any]) -> None:
        if any(len(r.output_token_ids) >= 2 for r in _poisoned(batch)):
            raise RuntimeError("simulated failure for one request")

    client, engine = await _started(_factory(tiny_chat_dir, fault))
    async with client:
        post = client.post
        results = await asyncio.wait_for(
            asyncio.gather(
                post("/v1/completions", json=_completion("hello there", 24)),
                post("/v1/completions", json=_completion("a stream", 24, stream=True)),
                post("/v1/completions", json=_completion([POISON, 5, 6], 24)),
                post("/v1/completions", json=_completion([POISON, 7], 24, stream=True)),
                post("/v1/completions", json=_completion([POISON, 8], 24, n=3)),
            ),
            HANG_GUARD_S,
        )
        plain, stream, failed, failed_stream, failed_n = results
        assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 24
        events = parse_sse(stream.text)
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        for response in (failed, failed_n):
            assert response.status_code == 500, response.text
            error = response.json()["error"]
            assert error["type"] == "InternalServerError" and error["code"] == 500
            assert "simulated failure for one request" in error["message"]
        assert failed_stream.status_code == 200  # the failure came after the headers
        *tokens, last = parse_sse(failed_stream.text)
        assert tokens and last["error"]["code"] == 500
        assert "simulated failure for one request" in last["error"]["message"]
        await _assert_idle_and_serving(client, engine)
        metrics = (await client.get("/metrics")).text
        assert 'vllm:request_success_total{finished_reason="error",model_name="tiny-chat"} 5.0' in (
            metrics
        )
    engine.shutdown()


@pytest.mark.asyncio
async def test_a_hung_step_turns_health_503_until_it_ends(tiny_chat_dir: Path) -> None:
    entered, release = threading.Event(), threading.Event()

    def fault(batch: list[Any]) -> None:
        if _poisoned(batch) and not release.is_set():
            entered.set()
            release.wait(HANG_GUARD_S)

    client, engine = await _started(_factory(tiny_chat_dir, fault), step_timeout=0.2)
    async with client:
        stuck = asyncio.create_task(client.post("/v1/completions", json=_completion([POISON], 2)))
        assert await asyncio.to_thread(entered.wait, HANG_GUARD_S)
        deadline = time.monotonic() + HANG_GUARD_S
        while (health := await client.get("/health")).status_code == 200:
            assert time.monotonic() < deadline, "the watchdog never fired"
            await asyncio.sleep(0.05)
        assert health.status_code == 503
        assert "in one step" in health.json()["error"]["message"]
        refused = await client.post("/v1/completions", json=_completion("hi", 2))
        assert refused.status_code == 503
        release.set()
        response = await asyncio.wait_for(stuck, HANG_GUARD_S)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
        await _assert_idle_and_serving(client, engine)
    engine.shutdown()


@pytest.mark.asyncio
async def test_work_caps_and_waiting_bound(tiny_chat_dir: Path) -> None:
    client, engine = await _started(
        _factory(tiny_chat_dir),
        max_request_choices=4,
        max_request_tokens=100,
        max_waiting_requests=3,
    )
    async with client:

        async def refused(body: dict[str, Any], param: str, words: str) -> None:
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == param and words in error["message"], error

        await refused(_completion(["a"] * 5, 2), "n", "5 completions (5 prompts x n=1)")
        await refused(_completion(["a", "b"], 2, n=3), "n", "the limit is 4")
        await refused(_completion("hello", 100), "max_tokens", "101 tokens")
        await refused(_completion([[1, 2, 3]] * 2, 40, n=2), "max_tokens", "172 tokens")
        # More engine requests than may ever wait at once: refused for good, not "retry".
        await refused(_completion(["a", "b"], 2, n=2), "n", "more than the 3 that may wait")
        chat = {"messages": [{"role": "user", "content": "hi"}], "n": 5, "max_tokens": 2}
        response = await client.post("/v1/chat/completions", json=chat)
        assert response.status_code == 400 and response.json()["error"]["param"] == "n"
        ok = await client.post("/v1/completions", json=_completion(["a", "b"], 2))
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
        await _assert_idle_and_serving(client, engine)
    engine.shutdown()


@pytest.mark.asyncio
async def test_large_prompts_and_chat_templates_leave_the_event_loop(tiny_chat_dir: Path) -> None:
    client, engine = await _started(_factory(tiny_chat_dir))
    assert engine.engine is not None and engine.engine.tokenizer is not None
    tokenizer = engine.engine.tokenizer
    loop_thread = threading.get_ident()
    seen: dict[str, set[int]] = {"encode": set(), "chat": set()}
    real_encode, real_chat = tokenizer.encode, tokenizer.apply_chat_template

    def encode(*args: Any, **kwargs: Any) -> list[int]:
        seen["encode"].add(threading.get_ident())
        return real_encode(*args, **kwargs)

    def chat_template(*args: Any, **kwargs: Any) -> str:
        seen["chat"].add(threading.get_ident())
        return real_chat(*args, **kwargs)

    tokenizer.encode = encode  # type: ignore[method-assign]
    tokenizer.apply_chat_template = chat_template  # type: ignore[method-assign]
    async with client:
        many = [f"prompt number {i} " * 8 for i in range(16)]  # 2 KiB+ in all
        response = await client.post("/v1/completions", json=_completion(many, 1))
        assert response.status_code == 200 and len(response.json()["choices"]) == 16
        assert seen["encode"] and loop_thread not in seen["encode"]
        seen["encode"].clear()
        small = await client.post("/v1/completions", json=_completion("short", 1))
        assert small.status_code == 200
        assert seen["encode"] == {loop_thread}  # a short prompt is not worth a thread hop
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
        assert seen["chat"] and loop_thread not in seen["chat"]
    engine.shutdown()
