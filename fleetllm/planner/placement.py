"""Where a replica runs, and so where its engine loads the model from: a pod in a cluster
(the model volumes mounted at fixed paths) or a process of `fleetllm up` on this machine (a
folder of the local cache). The planner writes that location into the engine's arguments, so
every runner starts the planned command as it is."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from fleetllm.api.source import ModelSource

MODEL_MOUNT = "/models"
"""Where a pvc:// source's claim is mounted in a pod."""
MODEL_CACHE_MOUNT = "/var/lib/fleetllm/models"
"""Where hf:// and s3:// weights are pulled to in a pod (the model cache volume)."""


def fills_cache(source: ModelSource, backend: str) -> bool:
    """Whether a pod's init container writes the model into the model cache volume before the
    engine starts: hf:// and s3:// weights, and a built-in model for vLLM, which cannot read
    its GGUF file (fleetllm's engine image, which ships the model, converts it into a Hugging
    Face folder there)."""
    return source.downloaded or (source.scheme == "builtin" and backend == "vllm")


@dataclass(frozen=True)
class ClusterPlacement:
    """A pod: the operator mounts a pvc:// claim at MODEL_MOUNT and pulls hf:// and s3://
    weights (and a built-in model converted for vLLM) into the model cache volume at
    MODEL_CACHE_MOUNT."""

    def model_path(self, source: ModelSource, backend: str = "builtin") -> str:
        """What the engine loads: a built-in model's name, or a folder in the pod."""
        if source.scheme in ("builtin", "file") and not fills_cache(source, backend):
            return source.location
        if source.scheme == "pvc":
            return f"{MODEL_MOUNT}/{source.path}" if source.path else MODEL_MOUNT
        return f"{MODEL_CACHE_MOUNT}/{source.cache_key()}"


@dataclass(frozen=True)
class LocalPlacement:
    """A process on this machine: a file:// source is a path here, and hf:// and s3://
    weights are pulled into `pulled`, a folder of the local cache, as into a pod's model
    cache volume. (A pvc:// claim exists only in a cluster; the local fleet refuses it.)
    vLLM cannot read a built-in model's GGUF file: it loads the Hugging Face folder the
    local fleet converts it into, named in `converted` (built-in name -> folder)."""

    pulled: Path
    converted: Mapping[str, str] = field(default_factory=dict)

    def model_path(self, source: ModelSource, backend: str = "builtin") -> str:
        """What the engine loads: a built-in model's name (its converted folder for vLLM), a
        local path, or the folder of the local cache the weights are pulled to."""
        if source.scheme == "builtin" and backend == "vllm":
            return self.converted.get(source.location, source.location)
        if source.scheme in ("builtin", "file"):
            return source.location
        return str(self.pulled / source.cache_key())


Placement = ClusterPlacement | LocalPlacement

IN_CLUSTER = ClusterPlacement()
