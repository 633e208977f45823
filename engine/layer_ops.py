"""The elementwise steps of a Llama layer: RMSNorm with the residual add before it, rotary
embedding of the queries and keys, and SiLU-and-mul.

`TorchLayerOps` is the reference: torch ops, on any device, with Hugging Face's numerics
operation for operation (norms in float32, RoPE tables in float32 cast to the model dtype).
`CpuLayerOps` runs each step as one pass of a C++ kernel (`csrc/cpu_layer_ops.cpp`) with the
same roundings, in place where torch would allocate: in torch RMSNorm alone is eight ops, and
every op is a pass over the activations and a parallel region whose threads meet at a barrier.

The model calls the ops of its `layer_ops` (`LlamaForCausalLM.set_layer_ops`); every method
takes and returns tensors only, so either implementation serves any caller.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch.nn import functional as F

# Whatever `rope_context` returns: built once per step, passed to every layer's `rotary`.
RopeContext = tuple[Any, ...]


class TorchLayerOps:
    def rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + residual), x + residual): the layer's input normalised, and the
        residual stream after adding x to it. Without a residual (the first layer), x is the
        stream. x may be overwritten."""
        if residual is not None:
            x = x + residual
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(dtype), x

    def rope_context(
        self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
    ) -> RopeContext:
        """What every layer's `rotary` needs for the step's positions, from float32
        [max_positions, head_dim] tables."""
        return cos[positions].to(dtype)[:, None, :], sin[positions].to(dtype)[:, None, :]

    def rotary(
        self, qkv: torch.Tensor, rope: RopeContext, heads: int, kv_heads: int, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, D] and k [T, kv_heads, D] rotated, and v [T, kv_heads, D], from the
        [T, (heads + 2 * kv_heads) * D] output of the fused projection. qkv may be
        overwritten."""
        t = qkv.shape[0]
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        cos, sin = rope
        q = q.view(t, heads, head_dim)
        k = k.view(t, kv_heads, head_dim)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v.view(t, kv_heads, head_dim)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up from [T, 2 * I] (gate, then up)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class CpuLayerOps(TorchLayerOps):
    """The same steps, each one in-place pass of the CPU kernels. The kernels take rows
    whose elements are adjacent; other layouts (an int8 layer's transposed output) are
    copied into that first."""

    def __init__(self, kernel: ModuleType) -> None:
        self.kernel = kernel

    def rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x.contiguous()  # the stream, which the next norms add into in place
            x = residual.clone()
            self.kernel.add_rms_norm(x, None, weight, eps)
        else:
            x = _rows(x)
            self.kernel.add_rms_norm(x, residual, weight, eps)
        return x, residual

    def rope_context(
        self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
    ) -> RopeContext:
        return positions, cos, sin

    def rotary(
        self, qkv: torch.Tensor, rope: RopeContext, heads: int, kv_heads: int, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        positions, cos, sin = rope
        qkv = _rows(qkv)
        self.kernel.rotary_qk(qkv, positions, cos, sin, heads, kv_heads, head_dim)
        t = qkv.shape[0]
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        return (
            q.view(t, heads, head_dim),
            k.view(t, kv_heads, head_dim),
            v.view(t, kv_heads, head_dim),
        )

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernel.silu_and_mul(gate_up.contiguous())


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x itself where its rows' elements are adjacent (rows may be apart), else a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()
