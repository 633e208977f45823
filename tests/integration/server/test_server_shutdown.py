"""SIGTERM drains: in-flight streams finish, new requests get 503, the process exits 0. A
failed or still-loading engine answers 503/500 JSON and never hangs a request."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from server_helpers import SERVED_NAME, ServerProcess, parse_sse, tiny_server_args, wait_until

from fleetllm.engine.async_engine import AsyncEngine
from fleetllm.engine.config import EngineConfig
from fleetllm.engine.engine import LLMEngine
from fleetllm.engine.server import ServerSettings, create_app

EXIT_GUARD_S = 60.0


class StreamThread(threading.Thread):
    """A streaming completion read to its end on a thread; `started` is set on the first
    token."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.started = threading.Event()
        self.raw = ""
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=120) as response:
                for text in response.iter_text():
                    self.raw += text
                    if '"text":"' in self.raw.replace('"text":""', ""):
                        self.started.set()
        except BaseException as exc:
            self.error = exc
        finally:
            self.started.set()


Stream = TypeVar("Stream", bound=StreamThread)


def start_streams(
    server: ServerProcess,
    count: int,
    max_tokens: int,
    kind: Callable[[str, dict[str, Any]], Stream] = StreamThread,
) -> list[Stream]:
    """`count` streams of `max_tokens` each, every one past its first token."""
    body = {
        "model": SERVED_NAME,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    url = f"{server.base_url}/v1/completions"
    threads = [kind(url, {**body, "prompt": f"Stream {i}"}) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        assert t.started.wait(EXIT_GUARD_S)
        assert t.error is None, t.error
    return threads


def _endings(threads: list[StreamThread]) -> list[tuple[str, int]]:
    """Each stream's last finish reason and its usage's completion tokens, once it ended."""
    endings = []
    for t in threads:
        t.join(EXIT_GUARD_S)
        assert not t.is_alive() and t.error is None
        events = parse_sse(t.raw)
        finish = [c["finish_reason"] for e in events for c in e["choices"]]
        endings.append((finish[-1], events[-1]["usage"]["completion_tokens"]))
    return endings


def test_sigterm_lets_8_streams_finish(
    launch: Callable[..., ServerProcess], tiny_chat_dir: Path
) -> None:
    # A grace period that cannot run out here, however busy the machine: all 8 must finish.
    server = launch(tiny_server_args(tiny_chat_dir, "--shutdown-grace-period", "300"))
    max_tokens = 200
    threads = start_streams(server, 8, max_tokens)
    assert server.metric("vllm:num_requests_running") == 8

    server.terminate()
    wait_until(
        lambda: httpx.get(f"{server.base_url}/health", timeout=10).status_code == 503,
        what="/health turns 503",
    )
    health = httpx.get(f"{server.base_url}/health", timeout=10)
    assert health.json()["error"]["code"] == 503
    refused = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": SERVED_NAME, "prompt": "late", "max_tokens": 2},
        timeout=10,
    )
    assert refused.status_code == 503
    assert refused.json()["error"]["type"] == "ServiceUnavailableError"

    for finish, tokens in _endings(threads):
        assert finish == "length" and tokens == max_tokens
    assert server.proc.wait(EXIT_GUARD_S) == 0


def test_grace_period_over_aborts_and_exits_0(
    launch: Callable[..., ServerProcess], tiny_chat_dir: Path
) -> None:
    args = tiny_server_args(tiny_chat_dir, "--shutdown-grace-period", "0.2")
    # A longer context than the shared server's, so these streams outlast the grace period.
    args[args.index("--max-model-len") + 1] = "2048"
    server = launch(args)
    threads = start_streams(server, 4, 2000)
    server.terminate()
    for finish, tokens in _endings(threads):
        assert finish == "abort" and tokens < 2000
    assert server.proc.wait(EXIT_GUARD_S) == 0


def test_sigterm_while_loading_exits_0(tmp_path: Path, tiny_chat_dir: Path) -> None:
    """The port is bound before the model is loaded; a SIGTERM then still exits cleanly."""
    server = ServerProcess(tiny_server_args(tiny_chat_dir), tmp_path / "server.log")
    try:

        def loading() -> bool:
            try:
                response = httpx.get(f"{server.base_url}/health", timeout=10)
            except httpx.TransportError:
                return False
            return response.status_code in {200, 503}

        wait_until(loading, what="the port answers")
        server.terminate()
        assert server.proc.wait(EXIT_GUARD_S) == 0, server.log_text()
    finally:
        server.stop()


def test_unknown_model_fails_fast() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fleetllm.cli", "engine", "serve", "--model", "/no/such/model"],
        capture_output=True,
        text=True,
        timeout=EXIT_GUARD_S,
        check=False,
    )
    assert result.returncode == 2
    assert "/no/such/model" in result.stderr


# -- in process: an engine that fails, or is still loading ---------------------------------


def _app(factory: Callable[[], LLMEngine]) -> tuple[Any, AsyncEngine]:
    app = create_app(ServerSettings(model_names=[SERVED_NAME]), factory)
    return app, app.state.server.engine


def _tiny_engine(model_dir: Path) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64, max_model_len=256)
    )


def _failing_engine(model_dir: Path, after_steps: int) -> Callable[[], LLMEngine]:
    def make() -> LLMEngine:
        engine = _tiny_engine(model_dir)
        real_step = engine.step
        calls = 0

        def step() -> Any:
            nonlocal calls
            calls += 1
            if calls > after_steps:
                raise RuntimeError("simulated device failure")
            return real_step()

        engine.step = step  # type: ignore[method-assign]
        return engine

    return make


async def _client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine")


def _assert_error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["type"] and error["message"]
    return str(error["message"])


@pytest.mark.asyncio
async def test_engine_failure_mid_request(tiny_chat_dir: Path) -> None:
    app, engine = _app(_failing_engine(tiny_chat_dir, after_steps=3))
    engine.start()
    await engine.wait_loaded()
    body = {"prompt": "hello", "max_tokens": 50, "ignore_eos": True}
    async with await _client(app) as client:
        in_flight = await asyncio.wait_for(client.post("/v1/completions", json=body), 60)
        assert "simulated device failure" in _assert_error(in_flight, 500)
        _assert_error(await client.get("/health"), 503)
        _assert_error(await client.post("/v1/completions", json=body), 503)
        _assert_error(await client.post("/v1/completions", json={**body, "stream": True}), 503)
        assert (await client.get("/metrics")).status_code == 200
    engine.shutdown()


@pytest.mark.asyncio
async def test_engine_failure_mid_stream(tiny_chat_dir: Path) -> None:
    app, engine = _app(_failing_engine(tiny_chat_dir, after_steps=3))
    engine.start()
    await engine.wait_loaded()
    body = {"prompt": "hello", "max_tokens": 50, "ignore_eos": True, "stream": True}
    async with await _client(app) as client:
        response = await asyncio.wait_for(client.post("/v1/completions", json=body), 60)
        assert response.status_code == 200
        events = parse_sse(response.text)
        *tokens, last = events
        assert len(tokens) >= 1 and all("choices" in e for e in tokens)
        assert last["error"]["code"] == 500
        assert "simulated device failure" in last["error"]["message"]
    engine.shutdown()


@pytest.mark.asyncio
async def test_health_503_until_loaded(tiny_chat_dir: Path) -> None:
    release = threading.Event()

    def slow() -> LLMEngine:
        assert release.wait(60)
        return _tiny_engine(tiny_chat_dir)

    app, engine = _app(slow)
    engine.start()
    async with await _client(app) as client:
        assert "loading" in _assert_error(await client.get("/health"), 503)
        body = {"prompt": "hi", "max_tokens": 2}
        assert "loading" in _assert_error(await client.post("/v1/completions", json=body), 503)
        metrics = await client.get("/metrics")
        assert metrics.status_code == 200 and "vllm:num_requests_running" in metrics.text
        release.set()
        await asyncio.wait_for(engine.wait_loaded(), 60)
        assert (await client.get("/health")).status_code == 200
        assert (await client.post("/v1/completions", json=body)).status_code == 200
    engine.shutdown()


@pytest.mark.asyncio
async def test_load_failure_is_reported(tmp_path: Path) -> None:
    def broken() -> LLMEngine:
        raise FileNotFoundError("model.safetensors is missing")

    app, engine = _app(broken)
    engine.start()
    with pytest.raises(FileNotFoundError):
        await asyncio.wait_for(engine.wait_loaded(), 60)
    async with await _client(app) as client:
        assert "missing" in _assert_error(await client.get("/health"), 503)
