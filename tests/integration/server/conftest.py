"""Engine servers as real subprocesses (`fleetllm engine serve`) on free ports.

Most tests share one server over the tiny chat model (float32, so batched and single results
agree exactly and can be compared with the offline API). Tests that change a server's state
for good (SIGTERM) or need other flags start their own with `launch`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

from server_helpers import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    NUM_KV_BLOCKS,
    ServerProcess,
    tiny_server_args,
)
from tinymodels import write_tiny_chat_model

from fleetllm.engine.llm import LLM


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@contextlib.contextmanager
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., ServerProcess]]:
    """Starts servers with the given arguments, each waited for until healthy; stops them
    all on leaving."""
    started: list[ServerProcess] = []

    def start(args: list[str], env: dict[str, str] | None = None) -> ServerProcess:
        log_path = tmp_path_factory.mktemp("server") / "server.log"
        server = ServerProcess(args, log_path, env)
        started.append(server)
        server.wait_healthy()
        return server

    try:
        yield start
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., ServerProcess]]:
    """Servers of one test module, stopped when the module ends: a SmolLM2 server with a
    large KV pool holds gigabytes, and the whole suite has to fit a 24 GiB machine."""
    with launcher(tmp_path_factory) as start:
        yield start


@pytest.fixture(scope="session")
def server(
    tmp_path_factory: pytest.TempPathFactory, tiny_chat_dir: Path
) -> Iterator[ServerProcess]:
    """The tiny model's server, shared by every module that needs nothing else."""
    with launcher(tmp_path_factory) as start:
        yield start(tiny_server_args(tiny_chat_dir))


@pytest.fixture(scope="session")
def offline_llm(tiny_chat_dir: Path) -> LLM:
    return LLM(
        str(tiny_chat_dir),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=NUM_KV_BLOCKS,
        block_size=BLOCK_SIZE,
    )
