"""A tiny random-weight chat model (SmolLM2's tokenizer and template) and its manifest."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

from tinymodels import write_tiny_chat_model

# The scaling figures are short so that a test sees a whole scale-up and scale-down: the
# tiny model runs at most 8 sequences at once, so 12 concurrent requests queue.
TINY_FLEET = """\
apiVersion: fleetllm.io/v1alpha1
kind: LLMDeployment
metadata:
  name: tiny
spec:
  model:
    name: tiny-chat
    source: file://tiny-chat
  gpu:
    type: cpu
  maxModelLen: 1024
  engine:
    drainSeconds: 20
  pod:
    resources:
      limits:
        memory: 768Mi
  scaling:
    minReplicas: 1
    maxReplicas: 2
    targetQueueTimeSeconds: 0.1
    scaleDownDelaySeconds: 4
"""


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_chat_model(tmp_path_factory.mktemp("models") / "tiny-chat")


@pytest.fixture(scope="session")
def tiny_manifest(tiny_model_dir: Path) -> Path:
    path = tiny_model_dir.parent / "tiny.yaml"
    path.write_text(TINY_FLEET)
    return path


@pytest.fixture
def fixed_manifest(tiny_model_dir: Path, tmp_path: Path) -> Callable[[int], Path]:
    """The tiny model at a fixed number of replicas (no autoscaling)."""

    def write(replicas: int) -> Path:
        text = TINY_FLEET.split("  scaling:", maxsplit=1)[0] + f"  replicas: {replicas}\n"
        text = text.replace("file://tiny-chat", f"file://{tiny_model_dir}")
        path = tmp_path / f"fixed-{replicas}.yaml"
        path.write_text(text)
        return path

    return write
