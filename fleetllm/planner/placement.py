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

    def adapter_path(
        self, adapter: ModelSource, model: ModelSource, model_cache_claim: str | None
    ) -> str:
        """Where the replicas read a LoRA adapter's files, which must reach running replicas
        without a change to their pods: a volume every replica mounts already. hf:// and s3://
        adapters are pulled into the model cache claim (`model_cache_claim`, the operator's
        --model-cache-claim); a pvc:// adapter must be on the model's own claim or on that
        one. ValueError saying why an adapter cannot reach them."""
        if adapter.scheme == "file":
            raise ValueError(
                f"{adapter.uri} is a path on one machine, served only by `fleetllm up`; in a "
                "cluster use hf://, s3:// or pvc://"
            )
        if adapter.scheme == "pvc":
            sub = f"/{adapter.path}" if adapter.path else ""
            if model.scheme == "pvc" and adapter.location == model.location:
                return MODEL_MOUNT + sub
            if adapter.location == model_cache_claim:
                return MODEL_CACHE_MOUNT + sub
            mounted = [f"the model's ({model.location})"] if model.scheme == "pvc" else []
            if model_cache_claim is not None:
                mounted.append(f"the model cache ({model_cache_claim})")
            raise ValueError(
                f"{adapter.uri}: the replicas do not mount the claim {adapter.location} (they "
                f"mount {' and '.join(mounted) or 'no claim'}); mounting another would restart "
                "them. Put the adapter on one of those, or give an hf:// or s3:// source"
            )
        if model_cache_claim is None:
            raise ValueError(
                f"{adapter.uri}: hf:// and s3:// adapters are pulled into the operator's model "
                "cache claim (--model-cache-claim), which every replica mounts; this operator "
                "has none. Set it, or put the adapter on the model's pvc:// claim"
            )
        return f"{MODEL_CACHE_MOUNT}/{adapter.cache_key()}"


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

    def adapter_path(self, adapter: ModelSource) -> str:
        """Where the replicas read a LoRA adapter: a local path, or the folder of the local
        cache its files are pulled to. ValueError for a pvc:// claim (a cluster's)."""
        if adapter.scheme == "pvc":
            raise ValueError(f"{adapter.uri}: a claim exists only in a cluster")
        return self.model_path(adapter)


Placement = ClusterPlacement | LocalPlacement

IN_CLUSTER = ClusterPlacement()
