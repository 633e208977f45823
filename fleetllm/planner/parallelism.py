"""How a replica's model splits over its devices: the tensor-parallel sizes each backend can
use, the refusal of the others, and the nearest valid sizes."""

from __future__ import annotations

from fleetllm.api.catalog import ModelArch
from fleetllm.planner.errors import PlanError

MAX_DEVICES_PER_REPLICA = 8
"""A replica runs on one node."""


def valid_tensor_sizes(arch: ModelArch, backend: str = "vllm") -> list[int]:
    """The builtin engine splits heads, KV heads and the MLP evenly; vLLM splits the heads
    and splits or replicates the KV heads."""
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


def nearest_tensor_sizes(arch: ModelArch, tensor: int, backend: str = "vllm") -> tuple[str, ...]:
    valid = [t for t in valid_tensor_sizes(arch, backend) if t > 1]
    sizes = sorted(valid, key=lambda t: abs(t - tensor))
    return tuple(f"parallelism.tensor: {t}" for t in sorted(sizes[:2]))


def check_builtin_parallelism(arch: ModelArch, tensor: int) -> None:
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
            nearest_tensor_sizes(arch, tensor, "builtin"),
            lead="Valid instead",
        )


def check_parallelism(arch: ModelArch, tensor: int, pipeline: int) -> None:
    """vLLM's rules: heads divide by the tensor size, KV heads divide or are replicated, and
    every pipeline stage gets a layer."""
    if arch.num_heads % tensor:
        raise PlanError(
            "ParallelismMismatch",
            f"{arch.name} has {arch.num_heads} attention heads, not divisible by tensor "
            f"parallelism {tensor}",
            nearest_tensor_sizes(arch, tensor),
            lead="Valid instead",
        )
    kv = arch.num_kv_heads
    if kv % tensor and tensor % kv:
        raise PlanError(
            "ParallelismMismatch",
            f"{arch.name} has {kv} KV heads; tensor parallelism {tensor} neither divides "
            f"nor is a multiple of it",
            nearest_tensor_sizes(arch, tensor),
            lead="Valid instead",
        )
    if pipeline > arch.num_layers:
        raise PlanError(
            "ParallelismMismatch",
            f"{arch.name} has {arch.num_layers} layers, fewer than pipeline stages {pipeline}",
        )
