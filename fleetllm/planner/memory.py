"""The memory arithmetic of one replica. All byte arithmetic is integer, so figures are
reproducible by hand:

    budget      = floor(device memory x memory utilization)
    weights     = (linear params x bytes/param(quantization) + other params x dtype bytes)
                  / (tensor x pipeline)
    overhead    = runtime + activations(max_num_batched_tokens) + logits(max_num_seqs)
    kv/token    = 2 x ceil(layers / pipeline) x max(1, kv_heads / tensor) x head_dim x kv bytes
    lora        = the adapter slots of spec.lora (`lora.lora_bytes`), 0 without
    capacity    = floor((budget - weights - overhead - lora) / kv/token), whole blocks of 16
                  tokens (128 for vLLM on a CPU, whose attention kernels need multiples of 32)

For the builtin engine, weights and kv/token are exactly what each of its ranks allocates
(the engine's own formulas, `fleetllm.engine.sizing`); a CPU replica's ranks share the pod's
memory, so there they are summed over the ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from fleetllm.api.catalog import GIB, GPUType, ModelArch
from fleetllm.api.lora import LoraSpec
from fleetllm.engine import sizing
from fleetllm.planner.lora import lora_bytes

BLOCK_SIZE = 16
# vLLM's CPU attention kernels take only multiples of 32 tokens a block; 128 is its own
# default there.
VLLM_CPU_BLOCK_SIZE = 128


@dataclass(frozen=True)
class ClassTuning:
    """Engine settings per accelerator class (what fits the memory and compute of the class)."""

    memory_utilization: Fraction
    """Share of device memory the engine may use; the rest is CUDA context and headroom, a
    roughly fixed size, so larger devices can give a larger share."""
    max_num_batched_tokens: int
    max_num_seqs: int


TUNING: dict[str, ClassTuning] = {
    "cpu": ClassTuning(Fraction(90, 100), sizing.CPU_MAX_NUM_BATCHED_TOKENS, 8),
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
# vLLM's CPU build runs two processes with torch loaded (the API server and the engine core),
# about 1.5 GiB resident together before any KV cache (SmolLM2-135M, vLLM 0.32).
RUNTIME_OVERHEAD_VLLM_CPU = 3 * GIB // 2

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Bytes per parameter of a quantized projection matrix. awq/gptq: 4-bit weights plus one
# 16-bit scale and one 4-bit zero point per group of 128.
QUANTIZED_LINEAR_BYTES = {
    "int8": Fraction(1),
    "fp8": Fraction(1),
    "awq": Fraction(1, 2) + Fraction(5, 2 * 128),
    "gptq": Fraction(1, 2) + Fraction(5, 2 * 128),
}


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
    block_size: int = BLOCK_SIZE
    lora_bytes: int = 0
    """LoRA's adapter slots (and on a CPU the adapters kept loaded beside them)."""

    @property
    def kv_budget_bytes(self) -> int:
        return self.budget_bytes - self.weights_bytes - self.overhead_bytes - self.lora_bytes

    @property
    def num_kv_blocks(self) -> int:
        return self.capacity_tokens // self.block_size

    def sequences(self, max_model_len: int) -> int:
        return self.capacity_tokens // max_model_len

    def fits(self, max_model_len: int) -> bool:
        """Whether the KV cache holds one sequence of `max_model_len` tokens."""
        return self.capacity_tokens >= max_model_len


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
    """Weight bytes one rank of the builtin engine holds (`sizing.weight_bytes_per_rank`; on a
    CPU node oneDNN is taken to run the dtype, so linears are packed where the engine packs
    them). Without an intermediate size the MLP's shape is unknown, and the model's weights
    are split evenly instead."""
    if arch.intermediate_size is None:
        return math.ceil(weight_bytes(arch, weights, dtype) / tensor)
    quantization = None if weights == "none" else weights
    return sizing.weight_bytes_per_rank(
        arch,
        tensor=tensor,
        dtype_bytes=DTYPE_BYTES[dtype],
        quantization=quantization,
        packed=sizing.packs_linears(device, quantization),
    )


def builtin_kv_bytes_per_token(arch: ModelArch, *, tensor: int, kv_cache: str, dtype: str) -> int:
    """KV bytes of one token on one rank of the builtin engine (its KV heads)."""
    return sizing.kv_bytes_per_token(
        num_layers=arch.num_layers,
        num_kv_heads=arch.num_kv_heads // tensor,
        head_dim=arch.head_dim,
        kv_cache_dtype=kv_cache,
        dtype_bytes=DTYPE_BYTES[dtype],
    )


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
    lora: LoraSpec | None = None,
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
        per_process = RUNTIME_OVERHEAD_VLLM_CPU if backend == "vllm" else RUNTIME_OVERHEAD_CPU
        runtime = per_process * (1 if devices == 1 else devices + 1)
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
    adapters = sharing * lora_bytes(
        arch, lora, tensor=tensor, pipeline=pipeline, dtype_bytes=dtype_bytes, on_gpu=gpu.is_gpu
    )
    free = budget - weights_per_device - overhead - adapters
    block = VLLM_CPU_BLOCK_SIZE if backend == "vllm" and not gpu.is_gpu else BLOCK_SIZE
    capacity = (max(0, free) // per_token) // block * block
    return MemoryEstimate(
        memory_bytes=memory,
        budget_bytes=budget,
        weights_bytes=weights_per_device,
        overhead_bytes=overhead,
        kv_bytes_per_token=per_token,
        capacity_tokens=capacity,
        tuning=tuning,
        block_size=block,
        lora_bytes=adapters,
    )


def gib(value: int) -> float:
    """Bytes as GiB, to two decimals (how status and messages show them)."""
    return round(value / GIB, 2)
