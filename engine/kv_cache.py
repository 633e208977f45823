"""The KV cache tensors of one rank, in the model dtype or quantized (int8, fp8).

A layer's K (and V) cache is a `[num_slots, kv_heads, head_dim]` tensor, one slot per token.
With `kv_cache_dtype="int8"` (or `"fp8"`, e4m3, on GPUs that have it) each slot stores its
values in one byte with one float32 scale per (token, KV head): symmetric absmax scaling, so
a token's K/V are quantized once, when written, and every read dequantizes to the model dtype.
Per-token scales keep the error of each token independent of what else shares its block.

Attention backends go through `write`, `select_slots` and `gather_blocks`, which accept either
form, so a backend never needs to know how the cache is stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fleetllm.engine.config import KV_CACHE_DTYPES

# float32: the planner counts sizing.KV_SCALE_BYTES per token and KV head for it.
SCALE_DTYPE = torch.float32
_QUANTIZED = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
# The largest magnitude each storage type represents (fp8 e4m3: 448).
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: float(torch.finfo(torch.float8_e4m3fn).max)}


@dataclass
class QuantizedKV:
    """One layer's K or V cache in one byte per value plus a scale per (slot, head)."""

    data: torch.Tensor  # [num_slots, kv_heads, head_dim], int8 or float8_e4m3fn
    scale: torch.Tensor  # [num_slots, kv_heads], float32

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


KVCache = torch.Tensor | QuantizedKV


def quantize(x: torch.Tensor, qdtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] values -> (quantized [..., D], float32 scales [...]): absmax over the last
    dimension maps onto the type's largest value."""
    x32 = x.to(torch.float32)
    qmax = _QMAX[qdtype]
    scale = x32.abs().amax(dim=-1) / qmax
    # An all-zero row gets scale 1, not 0, so that dividing by it stays finite.
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    scaled = x32 / scale[..., None]
    if qdtype == torch.int8:
        q = scaled.round_().clamp_(-qmax, qmax).to(torch.int8)
    else:
        q = scaled.clamp_(-qmax, qmax).to(qdtype)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.to(torch.float32) * scale[..., None]).to(dtype)


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_cache_dtype == "auto":
        return model_dtype
    return _QUANTIZED[kv_cache_dtype]


def check_kv_cache_dtype(kv_cache_dtype: str, device: torch.device) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r} is not supported; use {', '.join(KV_CACHE_DTYPES)}"
        )
    if kv_cache_dtype == "fp8" and not fp8_supported(device):
        raise ValueError(
            "kv_cache_dtype='fp8' needs a CUDA GPU with fp8 support (compute capability 8.9 "
            "or newer: Ada, Hopper); use kv_cache_dtype='int8' here"
        )


def fp8_supported(device: torch.device) -> bool:
    """fp8 (e4m3) storage and matmuls: Ada (8.9) and Hopper (9.0) GPUs onwards."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def allocate(
    num_slots: int,
    num_kv_heads: int,
    head_dim: int,
    kv_cache_dtype: str,
    dtype: torch.dtype,
    device: torch.device,
) -> KVCache:
    """One uninitialised layer cache (K or V); blocks are zeroed on first use (`zero`)."""
    shape = (num_slots, num_kv_heads, head_dim)
    if kv_cache_dtype == "auto":
        return torch.empty(shape, dtype=dtype, device=device)
    return QuantizedKV(
        torch.empty(shape, dtype=_QUANTIZED[kv_cache_dtype], device=device),
        torch.empty(shape[:2], dtype=SCALE_DTYPE, device=device),
    )


def zero(cache: KVCache, rows: slice) -> None:
    if isinstance(cache, QuantizedKV):
        _bytes(cache.data)[rows].zero_()
        cache.scale[rows].zero_()
    else:
        cache[rows].zero_()


def nbytes(cache: KVCache) -> int:
    if isinstance(cache, QuantizedKV):
        return cache.data.nbytes + cache.scale.nbytes
    return cache.nbytes


def write(cache: KVCache, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Store `x` [T, KVH, D] into `slots` [T]."""
    if isinstance(cache, QuantizedKV):
        q, scale = quantize(x, cache.data.dtype)
        _bytes(cache.data).index_copy_(0, slots, _bytes(q))
        cache.scale.index_copy_(0, slots, scale)
    else:
        cache.index_copy_(0, slots, x)


def select_slots(cache: KVCache, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values of `slots` [n] -> [n, KVH, D] in `dtype`."""
    if isinstance(cache, QuantizedKV):
        data = _bytes(cache.data).index_select(0, slots).view(cache.data.dtype)
        return dequantize(data, cache.scale.index_select(0, slots), dtype)
    return cache.index_select(0, slots)


def gather_blocks(
    cache: KVCache, block_ids: torch.Tensor, rows: int, block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """Flat block ids of `rows` sequences -> [rows, L, KVH, D] in `dtype`: one contiguous copy
    per block, not per token."""
    if isinstance(cache, QuantizedKV):
        data = _gather(_bytes(cache.data), block_ids, rows, block_size).view(cache.data.dtype)
        kv_heads = cache.scale.shape[1]
        scale = (
            cache.scale.view(-1, block_size * kv_heads)
            .index_select(0, block_ids)
            .view(rows, -1, kv_heads)
        )
        return dequantize(data, scale, dtype)
    return _gather(cache, block_ids, rows, block_size)


def _gather(
    cache: torch.Tensor, block_ids: torch.Tensor, rows: int, block_size: int
) -> torch.Tensor:
    _, kv_heads, head_dim = cache.shape
    blocks = cache.view(-1, block_size * kv_heads * head_dim).index_select(0, block_ids)
    return blocks.view(rows, -1, kv_heads, head_dim)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """The same memory as uint8: index operations exist for it on every device, while some
    are missing for float8 types (and zero bits are 0.0 in both one-byte formats)."""
    return x.view(torch.uint8)
