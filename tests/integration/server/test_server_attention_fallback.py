"""In process: when no Triton kernel can build or launch (a CUDA image without a C compiler,
say), the engine's GPU set-up falls back to the torch attention reference instead of failing,
logs it once, says so in /version, and serves. The kernels are made to fail on purpose; the
set-up is the one a CUDA device runs (no GPU is needed when both kernels fail: none is timed)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import SERVED_NAME

from fleetllm.engine import triton_attention
from fleetllm.engine.config import EngineConfig
from fleetllm.engine.engine import LLMEngine
from fleetllm.engine.server import ServerSettings, create_app

NO_COMPILER = "Failed to find C compiler. Please specify via CC environment variable."


def _no_compiler(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError(NO_COMPILER)


@pytest.mark.asyncio
async def test_the_engine_serves_on_torch_when_no_kernel_builds(
    tiny_chat_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(triton_attention, "paged_decode", _no_compiler)
    monkeypatch.setattr(triton_attention, "paged_prefill", _no_compiler)

    built: list[LLMEngine] = []

    def factory() -> LLMEngine:
        engine = LLMEngine(
            EngineConfig(
                model=str(tiny_chat_dir), dtype="float32", num_kv_blocks=64, max_model_len=256
            )
        )
        # What ModelRunner runs on a CUDA device, CUDA graphs asked for.
        engine.runner._setup_gpu(256, 4, enforce_eager=False)
        built.append(engine)
        return engine

    app = create_app(ServerSettings(model_names=[SERVED_NAME]), factory)
    engine = app.state.server.engine
    with caplog.at_level(logging.INFO):
        engine.start()
        await asyncio.wait_for(engine.wait_loaded(), 60)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
        body = {"prompt": "hello", "max_tokens": 4, "ignore_eos": True}
        answer = await client.post("/v1/completions", json=body)
        assert answer.status_code == 200
        assert answer.json()["usage"]["completion_tokens"] == 4
        version = (await client.get("/version")).json()
        metrics = (await client.get("/metrics")).text
    await asyncio.to_thread(engine.shutdown)

    attention = version["attention"]
    assert attention["decode"] == attention["prefill"] == "torch"
    assert NO_COMPILER in attention["fallback"]
    assert "decode" in attention["fallback"] and "prefill" in attention["fallback"]
    for phase in ("decode", "prefill"):
        assert (
            f'fleetllm:attention_backend_info{{backend="torch",fallback="true",'
            f'model_name="{SERVED_NAME}",phase="{phase}"}} 1.0'
        ) in metrics
    # No CUDA graphs to replay a kernel that does not run.
    assert built[0].runner.graphs is None
    warnings = [r for r in caplog.records if "falls back" in r.getMessage()]
    assert len(warnings) == 1
