"""Helpers for the server tests: a server subprocess, metrics reads, polling."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from local_services import free_port, stop_process
from prometheus_client.parser import text_string_to_metric_families

# The shared server's engine settings; `offline_llm` uses the same.
MAX_MODEL_LEN = 512
NUM_KV_BLOCKS = 1024
BLOCK_SIZE = 16
SERVED_NAME = "tiny-chat"
STARTUP_GUARD_S = 120.0  # hang guard only: a tiny model loads in about a second


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "fleetllm.cli", "engine", "serve"]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), *args]
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_GUARD_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"server not healthy in {STARTUP_GUARD_S}s:\n{self.log_text()}")

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()

    # -- metrics ------------------------------------------------------------------------------

    def metrics_text(self) -> str:
        response = httpx.get(f"{self.base_url}/metrics", timeout=10.0)
        response.raise_for_status()
        return response.text

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample: (sample name, sorted labels without model_name) -> value."""
        samples = {}
        for family in text_string_to_metric_families(self.metrics_text()):
            for s in family.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                samples[(s.name, labels)] = s.value
        return samples

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics()[(name, tuple(sorted(labels.items())))]


def wait_until(predicate: Callable[[], bool], guard_s: float = 30.0, what: str = "") -> float:
    """Poll until true; the seconds it took. The guard only keeps a broken server from
    hanging the suite."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > guard_s:
            raise AssertionError(f"not reached within the {guard_s}s hang guard: {what}")
        time.sleep(0.01)
    return time.monotonic() - start


def tiny_server_args(model_dir: Path, *extra: str) -> list[str]:
    return [
        "--model", str(model_dir),
        "--served-model-name", SERVED_NAME,
        "--dtype", "float32",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--num-kv-blocks", str(NUM_KV_BLOCKS),
        "--block-size", str(BLOCK_SIZE),
        # One torch thread: a tiny model gains nothing from more, and on a busy machine
        # (tests run beside other work) waiting for a second thread costs far more.
        "--num-threads", "1",
        *extra,
    ]  # fmt: skip


def post(server: ServerProcess, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60.0, **kwargs)


def parse_sse(raw: str) -> list[Any]:
    """Split an SSE body into its events, checking the framing: every event is one
    `data: <json>` line followed by a blank line, and the last one is `data: [DONE]`."""
    assert raw.endswith("\n\n"), raw[-200:]
    events: list[Any] = []
    for block in raw[:-2].split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block, block
        payload = block.removeprefix("data: ")
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events and events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


def assert_sound(server: ServerProcess) -> None:
    """Alive, healthy, idle with no block held, and answering a normal request."""
    assert server.proc.poll() is None, server.log_text()[-4000:]
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    wait_until(
        lambda: (
            server.metric("vllm:num_requests_running") == 0
            and server.metric("vllm:num_requests_waiting") == 0
            and server.metric("vllm:kv_cache_usage_perc") == 0.0
        ),
        what="an idle engine with every block free",
    )
    body = {"model": SERVED_NAME, "prompt": "hello", "max_tokens": 3, "ignore_eos": True}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3
