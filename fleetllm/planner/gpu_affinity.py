"""The `auto` GPU profile's node affinity: wherever a node carries a GPU label (GPU feature
discovery's, GKE's or Karpenter's), it must not name another catalog GPU type than the planned
one. `NotIn` also matches a node without the label, so clusters without labels, and autoscalers
that simulate a node before it has them, still schedule. Pure."""

from __future__ import annotations

from typing import Any

from fleetllm.api.catalog import (
    GKE_ACCELERATOR_LABEL,
    GPU_PRODUCT_LABEL,
    GPU_TYPES,
    KARPENTER_GPU_MEMORY_LABEL,
    KARPENTER_GPU_NAME_LABEL,
    GPUType,
)


def _label_values(gpu: GPUType) -> dict[str, str | None]:
    return {
        GPU_PRODUCT_LABEL: gpu.product_label,
        GKE_ACCELERATOR_LABEL: gpu.gke_accelerator,
        KARPENTER_GPU_NAME_LABEL: gpu.karpenter_name,
    }


def pinning_expressions(gpu: GPUType) -> list[dict[str, Any]]:
    """matchExpressions that keep a pod planned for `gpu` off nodes labelled as another type."""
    ours = _label_values(gpu)
    others = [g for g in GPU_TYPES.values() if g.is_gpu and g.name != gpu.name]
    expressions = []
    for key, value in ours.items():
        excluded = sorted(
            {v for g in others if (v := _label_values(g)[key]) is not None and v != value}
        )
        if excluded:
            expressions.append({"key": key, "operator": "NotIn", "values": excluded})
    # Karpenter names two cards alike (A100 40 and 80 GB): their memory tells them apart.
    twins = [g for g in others if g.karpenter_name and g.karpenter_name == gpu.karpenter_name]
    if gpu.karpenter_memory and twins:
        memories = sorted({str(g.memory_mib) for g in twins} - {str(gpu.memory_mib)})
        if memories:
            expressions.append(
                {"key": KARPENTER_GPU_MEMORY_LABEL, "operator": "NotIn", "values": memories}
            )
    return expressions


def pinning_affinity(gpu: GPUType) -> dict[str, Any]:
    return {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": pinning_expressions(gpu)}]
        }
    }
