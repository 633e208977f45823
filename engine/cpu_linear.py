"""Linear layers on the CPU with weights reordered once into oneDNN's blocked layout.

A plain `nn.Linear` in bfloat16/float16 makes oneDNN reorder the weight into its blocked
layout on every call; for the small batches of decoding that reordering costs as much as the
matmul. Reordering once at load time gives the same results at a fraction of the time. In
float32 on x86 the reordered weights also beat `nn.Linear`'s BLAS call: 1.3-2.5x at decode
batches of 8-64 rows and 1.1-1.25x at 512 (AVX2, docs/engine.md).
"""

from __future__ import annotations

import platform

import torch
from torch import nn

_DTYPE_SUPPORTED = {
    torch.bfloat16: "_is_mkldnn_bf16_supported",
    torch.float16: "_is_mkldnn_fp16_supported",
}


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    if dtype == torch.float32:
        return platform.machine() in ("x86_64", "AMD64")  # measured there, not elsewhere
    if dtype not in _DTYPE_SUPPORTED:
        return False
    check = getattr(ops, _DTYPE_SUPPORTED[dtype], None)
    return bool(check is not None and check())


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, batch_hint: int) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.register_buffer(
            "packed_weight",
            torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint),
        )
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


@torch.inference_mode()
def pack_linear_layers(model: nn.Module, batch_hint: int) -> int:
    """Replace every `nn.Linear` of `model` by a `PackedLinear`; returns how many.
    `batch_hint` is the typical number of rows per call (the decode batch)."""
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, PackedLinear(child, batch_hint))
                replaced += 1
    return replaced
