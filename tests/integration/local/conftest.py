"""A tiny random-weight chat model (SmolLM2's tokenizer and template) and its manifest."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

from tinymodels import write_tiny_chat_model

# Scaling for a test that sees a whole scale-up and scale-down in seconds: the tiny model runs
# at most 8 sequences at once (the plan's maxNumSeqs), so 12 concurrent requests need
# 12 / (8 x 0.8) = 1.9 replicas, short of the law's panic (2 x the ready replicas), which
# would hold every scale-down for its 60 s window; queue time (generous target) plays no part.
# The request rate can still hold the second replica up to that window after the load stops
# (the law's floor against shrinking back while requests come as fast as when it grew).
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
    targetQueueTimeSeconds: 30
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
