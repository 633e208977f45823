"""Tensors laid out as the engine's step hands them to its kernels."""

from __future__ import annotations

import torch


def rows_apart(x: torch.Tensor, gap: int) -> torch.Tensor:
    """x [n, heads, dim] as the rows of a wider buffer, `gap` elements apart (NaN between them),
    as the step's q, k and v are views of its fused qkv rows."""
    n, heads, dim = x.shape
    wide = torch.full((n, heads * dim + gap), float("nan"), dtype=x.dtype)
    wide[:, : heads * dim] = x.reshape(n, heads * dim)
    return wide[:, : heads * dim].view(n, heads, dim)
