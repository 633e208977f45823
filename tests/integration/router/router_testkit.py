"""Helpers for the router tests: engine and router processes, an in-process router, metrics
reads, and scripted upstreams for fault injection."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web
from local_services import free_port, stop_process
from prometheus_client.parser import text_string_to_metric_families

from fleetllm.router.config import RouterSettings
from fleetllm.router.discovery import Discovery, StaticDiscovery
from fleetllm.router.server import Router, RouterServer

STARTUP_GUARD_S = 120.0  # hang guard only


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`."""
    return sum(
        value
        for (sample, sample_labels), value in metric_samples(text).items()
        if sample == name and set(labels.items()) <= set(sample_labels)
    )


def wait_until(predicate: Callable[[], bool], what: str, guard_s: float = 60.0) -> None:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > guard_s:
            raise AssertionError(f"not reached within the {guard_s}s hang guard: {what}")
        time.sleep(0.02)


async def async_wait_until(
    predicate: Callable[[], bool | Awaitable[bool]], what: str, guard_s: float = 60.0
) -> None:
    start = time.monotonic()
    while True:
        result = predicate()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() - start > guard_s:
            raise AssertionError(f"not reached within the {guard_s}s hang guard: {what}")
        await asyncio.sleep(0.02)


class Process:
    """A `fleetllm ...` subprocess listening on 127.0.0.1:port, with its log in a file."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = self._spawn()

    def _spawn(self) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "fleetllm.cli", *self.args]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        return subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self) -> None:
        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                return httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, f"{self.args[:2]} on {self.port} healthy", STARTUP_GUARD_S)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def restart(self) -> None:
        """Start again on the same port (a replica coming back)."""
        assert self.proc.poll() is not None
        self.proc = self._spawn()

    def stop(self) -> None:
        stop_process(self.proc)

    def close(self) -> None:
        self.stop()
        self._log.close()

    def metrics_text(self) -> str:
        response = httpx.get(f"{self.url}/metrics", timeout=10.0)
        response.raise_for_status()
        return response.text


# Alpha replicas run at most this many sequences at a time, so that under load some
# requests wait in a replica's queue.
ALPHA_MAX_SEQS = 4


@dataclass
class EngineFleet:
    alpha: list[Process]
    beta: Process

    def all(self) -> list[Process]:
        return [*self.alpha, self.beta]


def engine_args(model_dir: Path, name: str, *extra: str) -> list[str]:
    return [
        "engine", "serve",
        "--model", str(model_dir),
        "--served-model-name", name,
        "--dtype", "float32",
        "--max-model-len", "1024",
        "--num-kv-blocks", "512",
        "--block-size", "16",
        "--num-threads", "1",
        *extra,
    ]  # fmt: skip


def write_fleet(path: Path, models: dict[str, Any]) -> None:
    """Replace the fleet file atomically, as a supervisor would."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"models": models}))
    os.replace(tmp, path)


@asynccontextmanager
async def serve_router(
    settings: RouterSettings | None = None,
    discovery: Discovery | None = None,
    **kwargs: Any,
) -> AsyncIterator[tuple[Router, str]]:
    """The real router in this process and event loop, on a free port."""
    router = Router(settings or RouterSettings(), discovery or StaticDiscovery(None), **kwargs)
    server = RouterServer(router)
    await server.start("127.0.0.1", 0)
    try:
        yield router, f"http://127.0.0.1:{server.port}"
    finally:
        await server.stop()


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@asynccontextmanager
async def serve_upstream(handler: Handler) -> AsyncIterator[str]:
    """A scripted stand-in for a replica, for failures a real engine cannot be made to show
    on cue (a 503, a stream cut in the middle of an event, a stall)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        return await handler(request)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
