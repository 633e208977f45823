"""Decode attention on the CPU with a C++ kernel (`csrc/cpu_paged_attention.cpp`).

The torch reference gathers every decode's blocks into a dense tensor padded to the longest
context and runs SDPA over all of it; on a CPU that is most of a decode step's attention time.
The kernel reads each sequence's own tokens straight from its blocks, once, in float32
arithmetic, on torch's threads (figures in docs/engine.md, "On a CPU"). It is built with the
engine's other CPU kernels (`cpu_kernels.py`); without them decode attention stays on the torch
reference.
"""

from __future__ import annotations

from types import ModuleType

import torch

from fleetllm.engine.attention import AttentionMetadata, TorchPagedAttention
from fleetllm.engine.kv_cache import KVCache

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def supported(dtype: torch.dtype, device: torch.device, kv_cache_dtype: str) -> bool:
    """Whether the kernel can serve this engine: a CPU, a cache in the model's dtype."""
    return device.type == "cpu" and kv_cache_dtype == "auto" and dtype in DTYPES


class CpuPagedAttention(TorchPagedAttention):
    """The reference with decodes run by the CPU kernel (prefill stays on SDPA, which is
    efficient for many query rows)."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, kernel: ModuleType
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.kernel = kernel

    def decode(
        self,
        q: torch.Tensor,
        k_cache: KVCache,
        v_cache: KVCache,
        md: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        n = md.num_decodes
        assert md.decode_tables is not None and md.decode_context_lens is not None
        self.kernel.paged_decode(
            q[:n].contiguous(),
            k_cache,
            v_cache,
            md.decode_tables,
            md.decode_context_lens,
            md.block_size,
            self.scale,
            out[:n],
        )
