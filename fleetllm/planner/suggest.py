"""What would make a refused replica fit: the smallest changes, cheapest first, each checked
against the same memory arithmetic."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

from fleetllm.api.catalog import GPU_TYPES, GPUType, ModelArch
from fleetllm.api.deployment import LLMDeploymentSpec
from fleetllm.planner.memory import MemoryEstimate, estimate
from fleetllm.planner.parallelism import MAX_DEVICES_PER_REPLICA, valid_tensor_sizes

# A suggested maxModelLen stays this far below the planned capacity: engines size their KV
# cache from what they measure at start, and vLLM refuses to start when it holds even one
# token less than maxModelLen.
SUGGESTION_MARGIN = Fraction(90, 100)


def suggestions(
    spec: LLMDeploymentSpec,
    arch: ModelArch,
    gpu: GPUType,
    dtype: str,
    max_model_len: int,
    current: MemoryEstimate,
) -> tuple[str, ...]:
    """The smallest changes that make the replica fit, cheapest first."""
    tp, pp = spec.parallelism.tensor, spec.parallelism.pipeline
    quant = spec.quantization
    backend = spec.engine.backend
    vllm = backend == "vllm"
    found: list[str] = []

    base: dict[str, Any] = {
        "tensor": tp,
        "pipeline": pp,
        "dtype": dtype,
        "weights": quant.weights,
        "kv_cache": quant.kv_cache,
        "backend": backend,
        "lora": spec.lora,
    }

    def fits(target: GPUType = gpu, **changes: Any) -> bool:
        return estimate(arch, target, **{**base, **changes}).fits(max_model_len)

    # More devices only add memory on GPUs (a CPU replica's ranks share one pod).
    for tensor in (2, 4, 8) if gpu.is_gpu else ():
        if tensor <= tp or tensor * pp > MAX_DEVICES_PER_REPLICA:
            continue
        if tensor not in valid_tensor_sizes(arch, backend):
            continue
        if fits(tensor=tensor):
            found.append(f"parallelism.tensor: {tensor} ({tensor} x {gpu.name})")
            break

    options = ["fp8"] if gpu.supports_fp8 else []
    options += ["int8", "awq"] if vllm else ["int8"]
    for weights in options:
        if weights == quant.weights or quant.weights in ("awq", "gptq"):
            continue
        if quant.weights == "int8" and weights == "fp8":
            continue  # no lighter
        if fits(weights=weights):
            # The builtin engine and vLLM's fp8 quantize at load; vLLM's int8 and awq need a
            # checkpoint quantized that way.
            quantized_at_load = weights == "fp8" or not vllm
            note = "" if quantized_at_load else f" (an {weights} checkpoint as model.source)"
            found.append(f"quantization.weights: {weights}{note}")
            break
    if quant.kv_cache == "auto":
        kv = "fp8" if gpu.supports_fp8 else ("int8" if not vllm else None)
        if kv is not None and fits(kv_cache=kv):
            found.append(f"quantization.kvCache: {kv}")

    for bigger in sorted(GPU_TYPES.values(), key=lambda g: g.memory_mib):
        if not bigger.is_gpu or bigger.memory_mib <= gpu.memory_mib or not gpu.is_gpu:
            continue
        if (quant.weights == "fp8" or quant.kv_cache == "fp8") and not bigger.supports_fp8:
            continue
        if fits(bigger):
            found.append(f"gpu.type: {bigger.name}")
            break

    suggested = suggested_max_model_len(current.capacity_tokens)
    if suggested >= 16:
        found.append(f"maxModelLen: {suggested} or less")
    return tuple(found)


def suggested_max_model_len(capacity_tokens: int) -> int:
    """A maxModelLen that fits with room to spare: SUGGESTION_MARGIN of the capacity, rounded
    down to a multiple of 256 (of 16 for short ones)."""
    room = math.floor(capacity_tokens * SUGGESTION_MARGIN)
    step = 256 if room >= 1024 else 16
    return room // step * step
