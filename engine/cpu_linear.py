"""Linear layers on the CPU with weights reordered once into oneDNN's blocked layout.

A plain `nn.Linear` in bfloat16/float16 makes oneDNN reorder the weight into its blocked
layout on every call; for the small batches of decoding that reordering costs as much as the
matmul. Reordering once at load time gives the same results at a fraction of the time. In
float32 on x86 the reordered weights also beat `nn.Linear`'s BLAS call: 1.3-2.5x at decode
batches of 8-64 rows and 1.1-1.25x at 512 (AVX2, docs/engine.md).

At one to `FEW_ROWS` rows (decoding one to a few sequences) a float32 layer is a pass over its
weight, bound by memory bandwidth, and the engine's own kernel (`csrc/cpu_few_rows_linear.cpp`)
makes that pass from the plain weight faster than oneDNN does from its layout: 1.1-1.3x over
every linear of SmolLM2 at one to four rows (docs/benchmarks-vllm.md). So a float32 layer keeps its
plain weight beside the reordered one (`sizing.keeps_plain_linears`; a tied LM head's plain
weight is the embedding itself), and runs few rows on the kernel once the engine hands it one
(`use_few_rows_kernel`).
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from types import ModuleType

import torch
from torch import nn

from fleetllm.engine import sizing

FEW_ROWS = 4
"""Rows at most that a float32 layer runs on the few-rows kernel (measured: from about six rows
on, oneDNN's reordered matmul is the faster)."""

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
        # The plain weight, for the few-rows kernel (float32 only). The same Parameter where
        # its rows are whole (a tied head shares it with the embedding); a tensor-parallel
        # shard read as a view of the checkpoint is made whole.
        plain = sizing.keeps_plain_linears(packed=True, dtype_bytes=linear.weight.element_size())
        weight = linear.weight if plain else None
        if weight is not None and not weight.is_contiguous():
            weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)
        self.weight = weight
        self.few_rows: Callable[..., torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.few_rows is not None and x.dim() == 2 and x.shape[0] <= FEW_ROWS:
            return self.few_rows(x.contiguous(), self.weight, self.bias)
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


def use_few_rows_kernel(model: nn.Module, kernel: ModuleType) -> int:
    """Run few rows of every float32 `PackedLinear` of `model` on the CPU kernels' few-rows
    pass; returns how many layers now do."""
    layers = [m for m in model.modules() if isinstance(m, PackedLinear) and m.weight is not None]
    for layer in layers:
        layer.few_rows = kernel.few_rows_linear
    return len(layers)
