"""The GPU capacity planner: model + accelerator + quantization + parallelism -> a memory
budget and tuned engine settings, or a refusal that says why and what would fit.

Pure: no I/O. All byte arithmetic is integer, so figures are reproducible by hand:

    budget      = floor(device memory x memory utilization)
    weights     = (linear params x bytes/param(quantization) + other params x dtype bytes)
                  / (tensor x pipeline)
    overhead    = runtime + activations(max_num_batched_tokens) + logits(max_num_seqs)
    kv/token    = 2 x ceil(layers / pipeline) x max(1, kv_heads / tensor) x head_dim x kv bytes
    capacity    = floor((budget - weights - overhead) / kv/token), whole blocks of 16 tokens

For the builtin engine, weights and kv/token are exactly what each of its ranks allocates
(`builtin_weight_bytes`, `builtin_kv_bytes_per_token`); a CPU replica's ranks share the pod's
memory, so there they are summed over the ranks.

A replica is refused when its capacity is below one maxModelLen sequence.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from fleetllm.api.catalog import (
    BUILTIN_MODELS,
    GIB,
    GPU_RESOURCE,
    GPU_TYPES,
    MODELS,
    GPUType,
    ModelArch,
    find_model,
)
from fleetllm.api.contract import ENGINE_PORT
from fleetllm.api.deployment import LLMDeploymentSpec
from fleetllm.api.quantity import parse_quantity
from fleetllm.api.source import ModelSource
from fleetllm.api.status import PlanStatus
from fleetllm.operator.config import DEFAULT_CONFIG, OperatorConfig
from fleetllm.operator.engine_args import ArgsRefused, flags_changed
from fleetllm.operator.images import ENGINE_CUDA_IMAGE, ENGINE_IMAGE, VLLM_IMAGE

BLOCK_SIZE = 16
MAX_DEVICES_PER_REPLICA = 8
# A suggested maxModelLen stays this far below the planned capacity: engines size their KV
# cache from what they measure at start, and vLLM refuses to start when it holds even one
# token less than maxModelLen.
SUGGESTION_MARGIN = Fraction(90, 100)


@dataclass(frozen=True)
class ClassTuning:
    """Engine settings per accelerator class (what fits the memory and compute of the class)."""

    memory_utilization: Fraction
    """Share of device memory the engine may use; the rest is CUDA context and headroom, a
    roughly fixed size, so larger devices can give a larger share."""
    max_num_batched_tokens: int
    max_num_seqs: int


TUNING: dict[str, ClassTuning] = {
    "cpu": ClassTuning(Fraction(90, 100), 512, 8),
    "24g": ClassTuning(Fraction(90, 100), 2048, 256),
    "40g": ClassTuning(Fraction(92, 100), 4096, 256),
    "80g": ClassTuning(Fraction(92, 100), 8192, 512),
    "141g": ClassTuning(Fraction(94, 100), 16384, 1024),
    "16g": ClassTuning(Fraction(90, 100), 2048, 128),
    "48g": ClassTuning(Fraction(92, 100), 4096, 256),
    "180g": ClassTuning(Fraction(94, 100), 16384, 1024),
}

# Memory a replica uses besides weights, KV cache and activations: CUDA graphs and allocator
# slack on GPUs (plus communication buffers when several devices work together), the Python
# and torch runtime on CPUs.
RUNTIME_OVERHEAD_GPU = 3 * GIB // 4
RUNTIME_OVERHEAD_MULTI_DEVICE = GIB // 4
RUNTIME_OVERHEAD_CPU = GIB // 2

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Bytes per parameter of a quantized projection matrix. awq/gptq: 4-bit weights plus one
# 16-bit scale and one 4-bit zero point per group of 128.
QUANTIZED_LINEAR_BYTES = {
    "int8": Fraction(1),
    "fp8": Fraction(1),
    "awq": Fraction(1, 2) + Fraction(5, 2 * 128),
    "gptq": Fraction(1, 2) + Fraction(5, 2 * 128),
}

# The builtin engine's quantized KV cache (int8, fp8) keeps one float32 scale per token and
# KV head beside the one-byte values.
BUILTIN_KV_SCALE_BYTES = 4
# The builtin engine's int8 weights: a 16-bit scale and offset per group of this many inputs
# of a row (a row whose length it does not divide is one group); fp8: a 16-bit scale per row.
BUILTIN_INT8_GROUP = 32
BUILTIN_WEIGHT_SCALE_BYTES = 2

VLLM_QUANTIZATION_FLAG = {
    # Pre-quantized checkpoints: name the fast Marlin kernels (vLLM picks the slow ones when
    # the plain method is forced); fp8 quantizes a 16-bit checkpoint at load.
    "int8": "compressed-tensors",
    "fp8": "fp8",
    "awq": "awq_marlin",
    "gptq": "gptq_marlin",
}


class PlanError(ValueError):
    """A refusal: the spec cannot run as written. `reason` is a condition reason."""

    def __init__(
        self, reason: str, message: str, suggestions: tuple[str, ...] = (), lead: str = "Fits with"
    ) -> None:
        full = message
        if suggestions:
            full = f"{message}. {lead}: {'; or '.join(suggestions)}"
        super().__init__(full)
        self.reason = reason
        self.message = full
        self.suggestions = suggestions


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-device memory figures of one replica."""

    memory_bytes: int
    budget_bytes: int
    weights_bytes: int
    overhead_bytes: int
    kv_bytes_per_token: int
    capacity_tokens: int
    tuning: ClassTuning

    @property
    def kv_budget_bytes(self) -> int:
        return self.budget_bytes - self.weights_bytes - self.overhead_bytes

    @property
    def num_kv_blocks(self) -> int:
        return self.capacity_tokens // BLOCK_SIZE

    def sequences(self, max_model_len: int) -> int:
        return self.capacity_tokens // max_model_len


def weight_bytes(arch: ModelArch, weights: str, dtype: str) -> int:
    """Bytes of all weights of the model (before splitting over devices)."""
    dtype_bytes = DTYPE_BYTES[dtype]
    if weights == "none":
        return arch.parameter_count() * dtype_bytes
    linear = arch.linear_parameters()
    other = arch.parameter_count() - linear
    return math.ceil(linear * QUANTIZED_LINEAR_BYTES[weights]) + other * dtype_bytes


def kv_bytes_per_token(arch: ModelArch, *, tensor: int, pipeline: int, kv_dtype_bytes: int) -> int:
    """KV bytes one token takes on one device. With more devices than KV heads each device
    holds a replica of one head."""
    layers = math.ceil(arch.num_layers / pipeline)
    kv_heads = max(1, arch.num_kv_heads // tensor)
    return 2 * layers * kv_heads * arch.head_dim * kv_dtype_bytes


def builtin_weight_bytes(
    arch: ModelArch, *, tensor: int, weights: str, dtype: str, device: str = "cpu"
) -> int:
    """Weight bytes one rank of the builtin engine holds: its share of every projection (heads
    and MLP split evenly), of the vocabulary (ceil(vocab / tensor) rows of the embedding and
    of an untied head), and the norms whole. Quantized: one byte per value of the
    projections, the embedding and the head, plus 16-bit scales: int8 a scale and an offset per
    group of 32 inputs of a row, fp8 a scale per row.
    On a CPU the engine keeps its matmul weights reordered for oneDNN, so a tied head is a
    second copy of the embedding there."""
    if arch.intermediate_size is None:
        return math.ceil(weight_bytes(arch, weights, dtype) / tensor)
    dtype_bytes = DTYPE_BYTES[dtype]
    hidden, head_dim = arch.hidden_size, arch.head_dim
    qkv_rows = (arch.num_heads + 2 * arch.num_kv_heads) // tensor * head_dim
    mlp = arch.intermediate_size // tensor
    # (rows, columns) of each matrix of a layer: qkv, o, gate+up, down.
    layer = [
        (qkv_rows, hidden),
        (hidden, arch.num_heads // tensor * head_dim),
        (2 * mlp, hidden),
        (hidden, mlp),
    ]
    vocab_rows = -(-arch.vocab_size // tensor)
    matrices = [*layer * arch.num_layers, (vocab_rows, hidden)]
    packed = device == "cpu" and weights == "none"
    if not arch.tied_embeddings or packed:
        matrices.append((vocab_rows, hidden))
    values = sum(rows * cols for rows, cols in matrices)
    norms = (2 * arch.num_layers + 1) * hidden
    bias = arch.num_layers * qkv_rows if arch.qkv_bias else 0
    unquantized = (norms + bias) * dtype_bytes
    if weights == "none":
        return values * dtype_bytes + unquantized
    if weights == "int8":
        groups = sum(rows * _int8_groups(cols) for rows, cols in matrices)
        scales = 2 * groups
    else:
        scales = sum(rows for rows, _ in matrices)
    return values * 1 + scales * BUILTIN_WEIGHT_SCALE_BYTES + unquantized


def _int8_groups(columns: int) -> int:
    return columns // BUILTIN_INT8_GROUP if columns % BUILTIN_INT8_GROUP == 0 else 1


def builtin_kv_bytes_per_token(arch: ModelArch, *, tensor: int, kv_cache: str, dtype: str) -> int:
    """KV bytes of one token on one rank of the builtin engine (its KV heads)."""
    per_head = (
        arch.head_dim * DTYPE_BYTES[dtype]
        if kv_cache == "auto"
        else arch.head_dim + BUILTIN_KV_SCALE_BYTES
    )
    return 2 * arch.num_layers * (arch.num_kv_heads // tensor) * per_head


def estimate(
    arch: ModelArch,
    gpu: GPUType,
    *,
    tensor: int = 1,
    pipeline: int = 1,
    dtype: str = "bfloat16",
    weights: str = "none",
    kv_cache: str = "auto",
    memory_bytes: int | None = None,
    backend: str = "vllm",
) -> MemoryEstimate:
    """Per-device budget of a replica; capacity is 0 when nothing is left for the KV cache.
    A CPU replica is one device: its tensor-parallel ranks share the pod's memory."""
    tuning = TUNING[gpu.gpu_class]
    memory = gpu.memory_bytes if memory_bytes is None else memory_bytes
    devices = tensor * pipeline
    dtype_bytes = DTYPE_BYTES[dtype]
    kv_dtype_bytes = dtype_bytes if kv_cache == "auto" else 1
    # Ranks that share this device's memory (several only for CPU replicas).
    sharing = 1 if gpu.is_gpu else devices

    budget = math.floor(memory * tuning.memory_utilization)
    intermediate = arch.intermediate_size or 4 * arch.hidden_size
    activations = (
        tuning.max_num_batched_tokens
        * (4 * arch.hidden_size + 2 * math.ceil(intermediate / tensor))
        * dtype_bytes
        * sharing
    )
    logits = tuning.max_num_seqs * arch.vocab_size * 4
    if gpu.is_gpu:
        runtime = RUNTIME_OVERHEAD_GPU + (RUNTIME_OVERHEAD_MULTI_DEVICE if devices > 1 else 0)
    else:
        # The engine process, plus one worker process per rank when there are several.
        runtime = RUNTIME_OVERHEAD_CPU * (1 if devices == 1 else devices + 1)
    overhead = runtime + activations + logits
    if backend == "builtin":
        weights_per_device = sharing * builtin_weight_bytes(
            arch,
            tensor=tensor,
            weights=weights,
            dtype=dtype,
            device="cuda" if gpu.is_gpu else "cpu",
        )
        per_token = sharing * builtin_kv_bytes_per_token(
            arch, tensor=tensor, kv_cache=kv_cache, dtype=dtype
        )
    else:
        weights_per_device = math.ceil(weight_bytes(arch, weights, dtype) / devices) * sharing
        per_token = sharing * kv_bytes_per_token(
            arch, tensor=tensor, pipeline=pipeline, kv_dtype_bytes=kv_dtype_bytes
        )
    free = budget - weights_per_device - overhead
    capacity = (max(0, free) // per_token) // BLOCK_SIZE * BLOCK_SIZE
    return MemoryEstimate(
        memory_bytes=memory,
        budget_bytes=budget,
        weights_bytes=weights_per_device,
        overhead_bytes=overhead,
        kv_bytes_per_token=per_token,
        capacity_tokens=capacity,
        tuning=tuning,
    )


@dataclass(frozen=True)
class Plan:
    """Everything render needs, plus the figures reported in status.plan."""

    status: PlanStatus
    gpu: GPUType
    arch: ModelArch
    source: ModelSource
    estimate: MemoryEstimate
    command: tuple[str, ...]
    args: tuple[str, ...]
    total_weights_bytes: int
    node_selector: dict[str, str]
    """The GPU node labels of the chosen profile (empty when it asks for none)."""
    model_path: str
    """Where the engine loads the model from (a folder in the pod, or a built-in name)."""
    drain_seconds: int

    @property
    def devices(self) -> int:
        return self.status.gpu_count


def resolve_gpu(name: str) -> GPUType:
    gpu = GPU_TYPES.get(name)
    if gpu is None:
        raise PlanError(
            "UnknownGPUType", f"gpu.type {name!r} is not in the catalog ({', '.join(GPU_TYPES)})"
        )
    return gpu


def resolve_arch(spec: LLMDeploymentSpec) -> ModelArch:
    model = spec.model
    if model.config is not None:
        cfg = model.config
        heads = cfg.num_heads
        return ModelArch(
            name=model.architecture or model.name,
            num_layers=cfg.num_layers,
            hidden_size=cfg.hidden_size,
            num_heads=heads,
            num_kv_heads=cfg.num_kv_heads or heads,
            head_dim=cfg.head_dim or cfg.hidden_size // heads,
            vocab_size=cfg.vocab_size,
            max_position=cfg.max_position_embeddings,
            intermediate_size=cfg.intermediate_size,
            tied_embeddings=cfg.tied_embeddings,
            parameters=cfg.parameters,
        )
    if model.architecture is not None:
        arch = MODELS.get(model.architecture)
        if arch is None:
            raise PlanError(
                "UnknownModel",
                f"model.architecture {model.architecture!r} is not in the catalog "
                f"({', '.join(MODELS)}); give model.config instead",
            )
        return arch
    source = ModelSource.parse(model.source)
    if source.scheme == "builtin":
        if source.location not in BUILTIN_MODELS:
            raise PlanError(
                "UnknownModel",
                f"builtin://{source.location} is not a built-in model "
                f"({', '.join(f'builtin://{n}' for n in BUILTIN_MODELS)})",
            )
        return MODELS[BUILTIN_MODELS[source.location]]
    arch = find_model(f"{source.location}/{source.path}")
    if arch is None:
        raise PlanError(
            "UnknownModel",
            f"cannot tell the architecture of {model.source!r}: set model.architecture to one "
            f"of {', '.join(MODELS)}, or give model.config",
        )
    return arch


def _check_backend(spec: LLMDeploymentSpec, gpu: GPUType) -> None:
    backend = spec.engine.backend
    quant = spec.quantization
    tp, pp = spec.parallelism.tensor, spec.parallelism.pipeline
    if backend == "vllm" and not gpu.is_gpu:
        raise PlanError(
            "UnsupportedBackend",
            "the vllm backend needs a GPU; use engine.backend: builtin for gpu.type: cpu",
        )
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


def _check_builtin_parallelism(arch: ModelArch, tensor: int) -> None:
    """The builtin engine splits heads, KV heads and the MLP evenly over its ranks."""
    sizes = [("attention heads", arch.num_heads), ("KV heads", arch.num_kv_heads)]
    if arch.intermediate_size is not None:
        sizes.append(("intermediate size", arch.intermediate_size))
    bad = [f"{name} ({value})" for name, value in sizes if value % tensor]
    if bad:
        listed = bad[0] if len(bad) == 1 else f"{', '.join(bad[:-1])} and {bad[-1]}"
        raise PlanError(
            "ParallelismMismatch",
            f"{arch.name}'s {listed} {'is' if len(bad) == 1 else 'are'} not divisible by "
            f"tensor parallelism {tensor} (the builtin engine splits them evenly over its ranks)",
            _nearest_tensor_sizes(arch, tensor, "builtin"),
            lead="Valid instead",
        )


def _check_parallelism(arch: ModelArch, tensor: int, pipeline: int) -> None:
    if arch.num_heads % tensor:
        raise PlanError(
            "ParallelismMismatch",
            f"{arch.name} has {arch.num_heads} attention heads, not divisible by tensor "
            f"parallelism {tensor}",
            _nearest_tensor_sizes(arch, tensor),
            lead="Valid instead",
        )
    kv = arch.num_kv_heads
    if kv % tensor and tensor % kv:
        raise PlanError(
            "ParallelismMismatch",
            f"{arch.name} has {kv} KV heads; tensor parallelism {tensor} neither divides "
            f"nor is a multiple of it",
            _nearest_tensor_sizes(arch, tensor),
            lead="Valid instead",
        )
    if pipeline > arch.num_layers:
        raise PlanError(
            "ParallelismMismatch",
            f"{arch.name} has {arch.num_layers} layers, fewer than pipeline stages {pipeline}",
        )


def _valid_tensor_sizes(arch: ModelArch, backend: str = "vllm") -> list[int]:
    if backend == "builtin":
        return [
            t
            for t in range(1, MAX_DEVICES_PER_REPLICA + 1)
            if arch.num_heads % t == 0
            and arch.num_kv_heads % t == 0
            and (arch.intermediate_size or 0) % t == 0
        ]
    return [
        t
        for t in range(1, MAX_DEVICES_PER_REPLICA + 1)
        if arch.num_heads % t == 0 and (arch.num_kv_heads % t == 0 or t % arch.num_kv_heads == 0)
    ]


def _nearest_tensor_sizes(arch: ModelArch, tensor: int, backend: str = "vllm") -> tuple[str, ...]:
    valid = [t for t in _valid_tensor_sizes(arch, backend) if t > 1]
    sizes = sorted(valid, key=lambda t: abs(t - tensor))
    return tuple(f"parallelism.tensor: {t}" for t in sorted(sizes[:2]))


def _resolve_dtype(spec: LLMDeploymentSpec, gpu: GPUType, cpu_bf16: bool) -> str:
    if spec.engine.dtype == "bfloat16" and gpu.is_gpu and not gpu.supports_bf16:
        raise PlanError(
            "UnsupportedDtype",
            f"{gpu.name} ({gpu.architecture}) has no bfloat16; use engine.dtype: float16 (or auto)",
        )
    if spec.engine.dtype != "auto":
        return spec.engine.dtype
    # bf16 matmuls are slow on CPUs without bf16 instructions, and Turing GPUs lack them.
    if not gpu.is_gpu:
        return "bfloat16" if cpu_bf16 else "float32"
    return "bfloat16" if gpu.supports_bf16 else "float16"


def _check_source(spec: LLMDeploymentSpec, source: ModelSource) -> None:
    if source.scheme == "builtin" and spec.engine.backend != "builtin":
        raise PlanError(
            "UnsupportedSource",
            f"{spec.model.source} ships only in fleetllm's engine image; vLLM cannot load it. "
            "Use engine.backend: builtin, or an hf://, s3:// or pvc:// source",
        )


SHARED_ACCESS_MODES = frozenset({"ReadOnlyMany", "ReadWriteMany"})


def claims_to_check(spec: LLMDeploymentSpec, config: OperatorConfig) -> list[str]:
    """The PersistentVolumeClaims whose access modes decide whether the replicas can share
    them: a pvc:// source's, and the model cache's when weights are downloaded."""
    source = ModelSource.parse(spec.model.source)
    if source.scheme == "pvc":
        return [source.location]
    if source.downloaded and config.model_cache is not None:
        return [config.model_cache.claim_name]
    return []


def _most_replicas(spec: LLMDeploymentSpec) -> int:
    scaling = spec.scaling
    return max(spec.replicas, scaling.max_replicas if scaling is not None else 0)


def check_claims(
    spec: LLMDeploymentSpec,
    config: OperatorConfig,
    access_modes: Mapping[str, Sequence[str]],
) -> None:
    """Refuse claims the replicas cannot share. `access_modes`: claim -> spec.accessModes of
    the claims that exist (a missing one leaves its pods Pending, which they report)."""
    most = _most_replicas(spec)
    source = ModelSource.parse(spec.model.source)
    for claim in claims_to_check(spec, config):
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


def _check_gpu_resources(spec: LLMDeploymentSpec, gpu: GPUType) -> None:
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


def _node_selector(spec: LLMDeploymentSpec, gpu: GPUType, config: OperatorConfig) -> dict[str, str]:
    profile = spec.gpu.node_selector_profile or config.gpu_profile
    labels = gpu.node_labels(profile)
    if labels is None:
        raise PlanError(
            "NoNodeLabelForGPU",
            f"the {profile} node-selector profile has no label for gpu.type {gpu.name} (that "
            "cluster kind does not offer it); set gpu.nodeSelectorProfile: none and choose "
            "nodes with pod.nodeSelector",
        )
    return labels


def _memory_bytes(spec: LLMDeploymentSpec, gpu: GPUType) -> int:
    """Per-device memory; for cpu replicas the pod memory limit when one is given."""
    if not gpu.is_gpu and spec.pod.resources is not None:
        limit = spec.pod.resources.limits.get("memory")
        if limit is not None:
            return int(parse_quantity(limit))
    return gpu.memory_bytes


def _fits(est: MemoryEstimate, max_model_len: int) -> bool:
    return est.capacity_tokens >= max_model_len


def _suggestions(
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
    }

    def fits(target: GPUType = gpu, **changes: Any) -> bool:
        return _fits(estimate(arch, target, **{**base, **changes}), max_model_len)

    # More devices only add memory on GPUs (a CPU replica's ranks share one pod).
    for tensor in (2, 4, 8) if gpu.is_gpu else ():
        if tensor <= tp or tensor * pp > MAX_DEVICES_PER_REPLICA:
            continue
        if tensor not in _valid_tensor_sizes(arch, backend):
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


def _max_num_seqs(capacity: int, max_model_len: int, cap: int) -> int:
    """As many sequences as the KV cache holds at a typical working length (2048 tokens, or
    the whole context when shorter; few requests fill a long context), within the class cap,
    in multiples of 8 (the batch sizes CUDA graphs are captured for)."""
    typical = min(max_model_len, 2048)
    seqs = min(cap, max(1, capacity // typical))
    return seqs - seqs % 8 if seqs >= 8 else seqs


def _gib(value: int) -> float:
    return round(value / GIB, 2)


def plan(
    spec: LLMDeploymentSpec,
    config: OperatorConfig = DEFAULT_CONFIG,
    claim_access_modes: Mapping[str, Sequence[str]] | None = None,
    *,
    local: bool = False,
) -> Plan:
    """Plan one replica of `spec`, or raise PlanError with the reason and what would fit.
    `claim_access_modes`: the access modes of the claims in `claims_to_check` that exist.
    `local`: the replica runs as a process on this machine (`fleetllm up`), where file://
    sources are local paths (in a cluster they name nothing and are refused) and no node
    labels are chosen."""
    gpu = resolve_gpu(spec.gpu.type)
    _check_backend(spec, gpu)
    source = ModelSource.parse(spec.model.source)
    if source.scheme == "file" and not local:
        raise PlanError(
            "UnsupportedSource",
            f"model.source {spec.model.source!r} is a path on one machine, served only by "
            "`fleetllm up`; in a cluster use pvc://, hf://, s3:// or builtin://",
        )
    arch = resolve_arch(spec)
    _check_source(spec, source)
    # Node labels pick cluster nodes; a local replica runs on this machine.
    node_selector = {} if local else _node_selector(spec, gpu, config)
    check_claims(spec, config, claim_access_modes or {})
    _check_gpu_resources(spec, gpu)
    tp, pp = spec.parallelism.tensor, spec.parallelism.pipeline
    if spec.engine.backend == "builtin":
        _check_builtin_parallelism(arch, tp)
    else:
        _check_parallelism(arch, tp, pp)

    max_model_len = spec.max_model_len or arch.max_position
    if max_model_len > arch.max_position:
        raise PlanError(
            "MaxModelLenTooLong",
            f"maxModelLen {max_model_len} exceeds what {arch.name} supports "
            f"({arch.max_position} tokens)",
        )

    dtype = _resolve_dtype(spec, gpu, config.cpu_bf16)
    quant = spec.quantization
    memory = _memory_bytes(spec, gpu)
    est = estimate(
        arch,
        gpu,
        tensor=tp,
        pipeline=pp,
        dtype=dtype,
        weights=quant.weights,
        kv_cache=quant.kv_cache,
        memory_bytes=memory,
        backend=spec.engine.backend,
    )
    where = f"{tp * pp} x {gpu.name}" if gpu.is_gpu else f"cpu ({_gib(memory)} GiB)"
    if est.kv_budget_bytes <= 0:
        raise PlanError(
            "WeightsDoNotFit",
            f"{arch.name} weights ({_gib(est.weights_bytes)} GiB per device) and overhead "
            f"({_gib(est.overhead_bytes)} GiB) exceed the {_gib(est.budget_bytes)} GiB budget "
            f"of {where}",
            _suggestions(spec, arch, gpu, dtype, max_model_len, est),
        )
    if est.capacity_tokens < max_model_len:
        raise PlanError(
            "KVCacheTooSmall",
            f"{arch.name} on {where}: after weights ({_gib(est.weights_bytes)} GiB per device) "
            f"and overhead ({_gib(est.overhead_bytes)} GiB) the KV cache "
            f"({_gib(est.kv_budget_bytes)} GiB) holds {est.capacity_tokens} tokens, less than "
            f"one maxModelLen sequence of {max_model_len}",
            _suggestions(spec, arch, gpu, dtype, max_model_len, est),
        )

    tuning = est.tuning
    max_num_seqs = _max_num_seqs(est.capacity_tokens, max_model_len, tuning.max_num_seqs)
    if spec.engine.max_num_seqs is not None:
        max_num_seqs = min(max_num_seqs, spec.engine.max_num_seqs)
    batched = max(max_num_seqs, min(tuning.max_num_batched_tokens, est.capacity_tokens))
    kv_dtype = dtype if quant.kv_cache == "auto" else quant.kv_cache
    model_path = model_location(source)
    command, args = _engine_command(
        spec,
        gpu,
        model_path,
        dtype=dtype,
        max_model_len=max_model_len,
        est=est,
        max_num_seqs=max_num_seqs,
        batched=batched,
    )
    _check_extra_args(spec, args)
    image = spec.engine.image or _default_image(spec, gpu)
    status = PlanStatus(
        backend=spec.engine.backend,
        device="cuda" if gpu.is_gpu else "cpu",
        gpu_type=gpu.name,
        gpu_count=tp * pp if gpu.is_gpu else 0,
        device_memory_gib=_gib(est.memory_bytes),
        weights_gib=_gib(est.weights_bytes),
        kv_cache_gib=_gib(est.capacity_tokens * est.kv_bytes_per_token),
        overhead_gib=_gib(est.overhead_bytes),
        kv_bytes_per_token=est.kv_bytes_per_token,
        max_concurrent_tokens=est.capacity_tokens,
        max_concurrent_sequences=est.sequences(max_model_len),
        max_model_len=max_model_len,
        dtype=dtype,
        kv_cache_dtype=kv_dtype,
        weights=quant.weights,
        gpu_memory_utilization=float(tuning.memory_utilization),
        block_size=BLOCK_SIZE,
        num_kv_blocks=est.num_kv_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=batched,
        image=image,
        engine_args=[*args, *spec.engine.extra_args],
    )
    return Plan(
        status=status,
        gpu=gpu,
        arch=arch,
        source=source,
        estimate=est,
        command=command,
        args=(*args, *spec.engine.extra_args),
        total_weights_bytes=weight_bytes(arch, quant.weights, dtype),
        node_selector=node_selector,
        model_path=model_path,
        drain_seconds=spec.engine.drain_seconds,
    )


def _default_image(spec: LLMDeploymentSpec, gpu: GPUType) -> str:
    if spec.engine.backend == "vllm":
        return VLLM_IMAGE
    return ENGINE_CUDA_IMAGE if gpu.is_gpu else ENGINE_IMAGE


MODEL_MOUNT = "/models"
"""Where a pvc:// source's claim is mounted."""
MODEL_CACHE_MOUNT = "/var/lib/fleetllm/models"
"""Where hf:// and s3:// weights are pulled to (the model cache volume)."""


def model_location(source: ModelSource) -> str:
    """What the engine loads: a built-in model's name, a local path (file://, for
    `fleetllm up`), or a folder in the pod."""
    if source.scheme in ("builtin", "file"):
        return source.location
    if source.scheme == "pvc":
        return f"{MODEL_MOUNT}/{source.path}" if source.path else MODEL_MOUNT
    return f"{MODEL_CACHE_MOUNT}/{source.cache_key()}"


def _engine_command(
    spec: LLMDeploymentSpec,
    gpu: GPUType,
    model_path: str,
    *,
    dtype: str,
    max_model_len: int,
    est: MemoryEstimate,
    max_num_seqs: int,
    batched: int,
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    drain = str(spec.engine.drain_seconds)
    common = (
        "--host",
        "0.0.0.0",
        "--port",
        str(ENGINE_PORT),
        "--served-model-name",
        spec.model.name,
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--block-size",
        str(BLOCK_SIZE),
    )
    quant = spec.quantization
    if spec.engine.backend == "builtin":
        # An explicit block count, not a memory fraction: the pool is exactly what was planned
        # and reported, whatever else shares the device or the pod's memory.
        builtin = [
            "--model",
            model_path,
            *common,
            "--device",
            "cuda" if gpu.is_gpu else "cpu",
            "--shutdown-grace-period",
            drain,
            "--num-kv-blocks",
            str(est.num_kv_blocks),
            "--max-num-seqs",
            str(max_num_seqs),
            "--max-num-batched-tokens",
            str(batched),
        ]
        if spec.parallelism.tensor > 1:
            builtin += ["--tensor-parallel-size", str(spec.parallelism.tensor)]
        if quant.weights != "none":
            builtin += ["--quantization", quant.weights]
        if quant.kv_cache != "auto":
            builtin += ["--kv-cache-dtype", quant.kv_cache]
        return ("fleetllm", "engine", "serve"), (*builtin, *_speculative_args(spec))
    # `vllm serve MODEL`: the positional form (vLLM deprecates --model there).
    args = [
        model_path,
        *common,
        # Drain on SIGTERM: running requests get this long before vLLM stops.
        "--shutdown-timeout",
        drain,
        "--gpu-memory-utilization",
        f"{float(est.tuning.memory_utilization):.2f}",
        "--max-num-seqs",
        str(max_num_seqs),
        "--max-num-batched-tokens",
        str(batched),
        "--tensor-parallel-size",
        str(spec.parallelism.tensor),
        "--pipeline-parallel-size",
        str(spec.parallelism.pipeline),
        "--enable-prefix-caching",
    ]
    if quant.weights != "none":
        flag = VLLM_QUANTIZATION_FLAG[quant.weights]
        if gpu.compute_capability is not None and gpu.compute_capability < (8, 0):
            flag = flag.removesuffix("_marlin")  # Marlin kernels need Ampere or later
        args += ["--quantization", flag]
    if quant.kv_cache != "auto":
        args += ["--kv-cache-dtype", quant.kv_cache]
    args += _speculative_args(spec)
    return ("vllm", "serve"), tuple(args)


def _speculative_args(spec: LLMDeploymentSpec) -> list[str]:
    """`--speculative-config` as JSON with vLLM's keys (both backends read the same)."""
    speculative = spec.speculative
    if speculative is None:
        return []
    config = {
        "method": speculative.method,
        "num_speculative_tokens": speculative.num_speculative_tokens,
        "prompt_lookup_max": speculative.prompt_lookup_max,
        "prompt_lookup_min": speculative.prompt_lookup_min,
    }
    return ["--speculative-config", json.dumps(config, separators=(",", ":"))]


# Flags the planner decides, and the spec field to use instead.
OWNED_FLAGS = {
    "--model": "model.source",
    "--revision": "model.source (hf://org/name@revision)",
    "--load-format": "model.source",
    "--host": "(fixed)",
    "--port": "(fixed)",
    "--served-model-name": "model.name",
    "--dtype": "engine.dtype",
    "--device": "gpu.type",
    "--shutdown-timeout": "engine.drainSeconds",
    "--shutdown-grace-period": "engine.drainSeconds",
    "--max-model-len": "maxModelLen",
    "--block-size": "(planned)",
    "--num-kv-blocks": "(planned)",
    "--kv-cache-memory-fraction": "(planned)",
    "--gpu-memory-utilization": "(planned)",
    "--max-num-seqs": "engine.maxNumSeqs",
    "--max-num-batched-tokens": "(planned)",
    "--tensor-parallel-size": "parallelism.tensor",
    "-tp": "parallelism.tensor",
    "--pipeline-parallel-size": "parallelism.pipeline",
    "-pp": "parallelism.pipeline",
    "--quantization": "quantization.weights",
    "-q": "quantization.weights",
    "--kv-cache-dtype": "quantization.kvCache",
    "--speculative-config": "speculative",
}


def _check_extra_args(spec: LLMDeploymentSpec, planned: Sequence[str]) -> None:
    extra = spec.engine.extra_args
    for arg in extra:
        flag = arg.split("=", 1)[0]
        if flag in OWNED_FLAGS:
            raise PlanError(
                "InvalidEngineArgs",
                f"engine.extraArgs sets {flag}, which the planner owns; {_instead(flag)}",
            )
    if spec.engine.backend != "builtin" or not extra:
        return  # vLLM's own CLI is not here to ask; it refuses unknown flags at start
    try:
        changed = flags_changed(planned, extra)
    except ArgsRefused as exc:
        raise PlanError(
            "InvalidEngineArgs",
            f"engine.extraArgs: `fleetllm engine serve` refuses {' '.join(extra)!r}: {exc}",
        ) from None
    owned = [flag for flag in changed if flag in OWNED_FLAGS]
    if owned:
        raise PlanError(
            "InvalidEngineArgs",
            f"engine.extraArgs sets {owned[0]} (under another spelling), which the planner "
            f"owns; {_instead(owned[0])}",
        )


def _instead(flag: str) -> str:
    field = OWNED_FLAGS[flag]
    return "it is not configurable" if field.startswith("(") else f"use {field}"
