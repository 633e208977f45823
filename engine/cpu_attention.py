"""Attention on the CPU with C++ kernels over the paged KV cache: decode
(`csrc/cpu_paged_attention.cpp`) and prefill (`csrc/cpu_paged_prefill.cpp`).

The torch reference gathers every decode's blocks into a dense tensor padded to the longest
context and runs SDPA over all of it; on a CPU that is most of a decode step's attention time.
The decode kernel reads each sequence's own tokens straight from its blocks, once, in float32
arithmetic, on torch's threads (figures in docs/engine.md, "On a CPU"). For prefill the
reference gathers each chunk's cached context and runs SDPA once per chunk, which on a CPU
reaches about half of what the prefill kernel does (1.4-2.3x slower on SmolLM2's chunks,
docs/benchmarks-vllm.md); the kernel reads every chunk's context from its blocks, all chunks of a
step in one call. Both are built with the engine's other CPU kernels (`cpu_kernels.py`);
without them attention stays on the torch reference.
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
    """The reference with both phases run by the CPU kernels."""

    reads_whole_blocks = False  # the kernels read only the slots a sequence has written

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, kernel: ModuleType
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.kernel = kernel

    def write(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: KVCache,
        v_cache: KVCache,
        md: AttentionMetadata,
    ) -> None:
        # Both in one call; the caches are plain tensors in the model's dtype (`supported`).
        self.kernel.write_kv_cache(k_cache, v_cache, md.slot_mapping, k, v)

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
            q[:n],  # rows of the step's qkv: the kernel reads them where they are
            k_cache,
            v_cache,
            md.decode_tables,
            md.decode_context_lens,
            md.block_size,
            self.scale,
            out[:n],
        )

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: KVCache,
        v_cache: KVCache,
        md: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        # The chunks' own K/V are in the cache already (written before attention): the kernel
        # reads every key from there, cached context and new tokens alike.
        pb = md.prefill_batch
        assert pb is not None
        self.kernel.paged_prefill(
            q,  # rows of the step's qkv: the kernel reads them where they are
            k_cache,
            v_cache,
            pb.tables,
            pb.q_starts,
            pb.q_lens,
            pb.context_lens,
            md.block_size,
            self.scale,
            out,
        )
