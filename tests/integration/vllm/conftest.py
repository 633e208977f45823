"""The vLLM tier: fixtures over vLLM's own environment (skipped without it, failed where
FLEETLLM_WITH_VLLM=1 promised it; see tests/vllm_tier.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_parser import VllmParser
from vllm_tier import requires_vllm

__all__ = ["requires_vllm", "vllm_parser"]


@pytest.fixture(scope="session")
def vllm_parser(requires_vllm: Path) -> Iterator[VllmParser]:
    """vLLM's argument parser in a process of vLLM's Python, shared by the whole run."""
    parser = VllmParser(requires_vllm)
    yield parser
    parser.close()
