"""The vLLM tier: tests that run vLLM's CPU build for real.

They need vLLM's own environment (`FLEETLLM_WITH_VLLM=1 scripts/setup.sh` makes `.venv-vllm`,
or `$FLEETLLM_VLLM_PYTHON` names its Python). Without it they skip, saying how to install it;
where the run promises vLLM (`FLEETLLM_WITH_VLLM=1`, as CI sets) a missing vLLM fails them
instead, so the tier can never pass by skipping.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fleetllm.local.vllm import INSTALL_HINT, find_vllm_python

PROMISED = "FLEETLLM_WITH_VLLM"


def vllm_python() -> Path:
    """vLLM's Python, or the test skips (fails where vLLM was promised) with the reason."""
    python = find_vllm_python()
    if python is not None:
        return python
    reason = f"vLLM's CPU build is not installed: {INSTALL_HINT}"
    if os.environ.get(PROMISED) == "1":
        pytest.fail(f"{PROMISED}=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def requires_vllm() -> Path:
    """A test (or fixture) that takes this runs only where vLLM is; its value is vLLM's Python."""
    return vllm_python()
