"""Real engine processes on tiny random models, shared by the router tests of the session.

Two models: `alpha` (three replicas) and `beta` (one), with different weights so that an
answer shows which model gave it. `gamma` gets its single replica only when a test asks for
it (the scale-from-zero tests register it while requests wait). Alpha replicas run at most
four sequences at a time, so that under load some requests wait in a replica's queue.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

from router_testkit import ALPHA_MAX_SEQS, EngineFleet, Process, engine_args
from tinymodels import write_tiny_chat_model


def _start_all(processes: list[Process]) -> None:
    errors: list[BaseException] = []

    def wait(p: Process) -> None:
        try:
            p.wait_healthy()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=wait, args=(p,)) for p in processes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for p in processes:
            p.close()
        raise errors[0]


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("router-models")
    return {
        name: write_tiny_chat_model(base / name, seed=seed)
        for name, seed in (("alpha", 1), ("beta", 2), ("gamma", 3))
    }


@pytest.fixture(scope="session")
def engines(
    model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineFleet]:
    logs = tmp_path_factory.mktemp("engine-logs")
    alpha = [
        Process(
            engine_args(model_dirs["alpha"], "alpha", "--max-num-seqs", str(ALPHA_MAX_SEQS)),
            logs / f"alpha-{i}.log",
        )
        for i in range(3)
    ]
    beta = Process(engine_args(model_dirs["beta"], "beta"), logs / "beta.log")
    fleet = EngineFleet(alpha, beta)
    _start_all(fleet.all())
    yield fleet
    for p in fleet.all():
        p.close()


@pytest.fixture(scope="session")
def gamma_engine(
    model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[], Process]]:
    """Starts gamma's replica on first call (and waits until it is healthy)."""
    started: list[Process] = []

    def start() -> Process:
        if not started:
            log = tmp_path_factory.mktemp("engine-logs") / "gamma.log"
            started.append(Process(engine_args(model_dirs["gamma"], "gamma"), log))
            started[0].wait_healthy()
        return started[0]

    yield start
    for p in started:
        p.close()


@pytest.fixture()
def start_router(tmp_path: Path) -> Iterator[Callable[..., Process]]:
    """`fleetllm router serve ARGS...` as a subprocess, healthy."""
    routers: list[Process] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Process:
        router = Process(["router", "serve", *args], tmp_path / f"router-{len(routers)}.log", env)
        routers.append(router)
        router.wait_healthy()
        return router

    yield start
    for r in routers:
        r.close()
