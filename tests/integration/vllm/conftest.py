"""The vLLM tier's fixtures over vLLM's own environment (skipped without it, failed where
FLEETLLM_WITH_VLLM=1 promised it; see tests/vllm_tier.py): vLLM's argument parser, and two
replicas of SmolLM2 on vLLM's CPU build, started once for the whole run with the command
`fleetllm up` plans (every test that needs vLLM without `fleetllm up` uses these two), and the
manifest the tier's `fleetllm up` runs."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_parser import VllmParser
from vllm_testkit import MANIFEST, Replica
from vllm_tier import requires_vllm, vllm_python

from fleetllm.engine.model_files import resolve_model
from fleetllm.local.deployments import load_fleet
from fleetllm.local.launch import CorePool, LocalModel

os.environ["HF_HUB_OFFLINE"] = "1"

__all__ = ["requires_vllm", "vllm_parser"]


@pytest.fixture(scope="session")
def vllm_parser(requires_vllm: Path) -> Iterator[VllmParser]:
    """vLLM's argument parser in a process of vLLM's Python, shared by the whole run."""
    parser = VllmParser(requires_vllm)
    yield parser
    parser.close()


@pytest.fixture(scope="session")
def vllm() -> Path:
    """vLLM's Python; without it the tier skips, or fails where it was promised."""
    return vllm_python()


@pytest.fixture(scope="session")
def vllm_manifest(vllm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The folder vLLM loads: the built-in model converted once (as `fleetllm up` does first).
    resolve_model("builtin://smollm2-135m")
    path = tmp_path_factory.mktemp("vllm") / "smollm2-vllm.yaml"
    path.write_text(MANIFEST)
    return path


@pytest.fixture(scope="session")
def vllm_model(vllm_manifest: Path, vllm: Path) -> LocalModel:
    (model,) = load_fleet([vllm_manifest], vllm=vllm)
    return model


@pytest.fixture(scope="session")
def vllm_replicas(
    vllm_model: LocalModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Replica]]:
    """Two vLLM replicas, started together (each loads while the other does), each on its
    own slot of the cores, as `fleetllm up` runs them."""
    logs = tmp_path_factory.mktemp("vllm-logs")
    cores = CorePool(sorted(os.sched_getaffinity(0)), 2)
    replicas = [Replica(vllm_model, logs / f"vllm-{i}.log", cores.take()) for i in range(2)]
    try:
        for replica in replicas:
            replica.wait_healthy()
        yield replicas
    finally:
        # Nothing is checked of how these stop (the drain tests start their own): SIGKILL
        # spares the run vLLM's graceful exit, up to 30 s a replica.
        for replica in replicas:
            replica.kill()
            replica.close()
