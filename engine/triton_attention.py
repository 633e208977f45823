"""Paged attention kernels in Triton: decode and prefill read K/V straight from the paged cache
through the block tables, with no gather into contiguous tensors.

Both handle grouped-query attention: the decode kernel runs one program per (sequence, kv
head) and serves all of that kv head's query heads from one read of its K/V; the prefill
kernel runs one program per (chunk, query head, tile of query rows), with causal masking
offset by the chunk's cached context, so chunked prefill and prefix-cache hits need nothing
else. Inputs are bfloat16, float16 or float32; softmax and accumulation are in float32.

Under Triton's interpreter (`TRITON_INTERPRET=1`, on the CPU) these same kernels run in numpy,
which is how the CPU test suite checks them against the torch reference. numpy has no
bfloat16, so there the operands of `tl.dot` are widened to float32 first (`UPCAST`); on a GPU
they stay in the input dtype, for the tensor cores.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fleetllm.engine.attention import AttentionMetadata, TorchPagedAttention, build_metadata

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# The smallest dimension tl.dot takes.
MIN_DOT = 16


def _pow2(n: int, floor: int = MIN_DOT) -> int:
    return max(floor, triton.next_power_of_2(n))


@triton.jit
def _kv_tile(
    k_head_ptr,  # the cache's keys of one kv head (slot 0)
    v_head_ptr,
    table_ptr,  # the sequence's row of block ids
    pos,  # [N] positions in the sequence
    valid,  # [N] which of them to read
    d,
    d_ok,
    stride_cs,
    BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """The keys and values at positions `pos` ([N, D] each, zeros where not `valid`), read
    through the block table from the paged cache."""
    block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=valid, other=0)
    slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
    offs = slot[:, None] * stride_cs + d[None, :]
    kv_ok = valid[:, None] & d_ok[None, :]
    k = tl.load(k_head_ptr + offs, mask=kv_ok, other=0.0)
    v = tl.load(v_head_ptr + offs, mask=kv_ok, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _softmax_step(s, v, m, denom, acc):
    """One tile of the online softmax: scores `s` [M, N] over values `v` [N, D] folded into
    the running row maxima `m`, denominators and weighted sums `acc` [M, D]."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    denom = denom * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, denom, acc


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # [N, H, D]
    k_cache_ptr,  # [slots, KVH, D]
    v_cache_ptr,
    out_ptr,  # [N, H, D]
    tables_ptr,  # [N, W] block ids
    lens_ptr,  # [N] context lengths
    scale,
    stride_qt,
    stride_qh,
    stride_cs,
    stride_ch,
    stride_tr,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_P: tl.constexpr,  # GROUP padded for tl.dot
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    TILE: tl.constexpr,  # tokens per iteration, a multiple of BLOCK_SIZE
    UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    ctx = tl.load(lens_ptr + seq)
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, HEAD_DIM_P)
    n = tl.arange(0, TILE)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(
        q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    m = tl.full([GROUP_P], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_DIM_P], tl.float32)
    k_head = k_cache_ptr + kvh * stride_ch
    v_head = v_cache_ptr + kvh * stride_ch
    table = tables_ptr + seq * stride_tr
    for start in range(0, ctx, TILE):
        pos = start + n
        valid = pos < ctx
        k, v = _kv_tile(k_head, v_head, table, pos, valid, d, d_ok, stride_cs, BLOCK_SIZE, UPCAST)
        s = tl.dot(q, tl.trans(k)) * scale  # [GROUP_P, TILE]
        s = tl.where(valid[None, :], s, float("-inf"))
        m, denom, acc = _softmax_step(s, v, m, denom, acc)
    # A context of 0 (a padding row of a captured batch) gives zeros, not NaN.
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(
        out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=g_ok[:, None] & d_ok[None, :],
    )


@triton.jit
def _paged_prefill_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [slots, KVH, D]
    v_cache_ptr,
    out_ptr,  # [T, H, D]
    tables_ptr,  # [C, W] block ids of each chunk's sequence
    q_start_ptr,  # [C] first row of each chunk in q
    q_len_ptr,  # [C]
    ctx_len_ptr,  # [C] tokens in the cache after this step, the chunk included
    scale,
    stride_qt,
    stride_qh,
    stride_cs,
    stride_ch,
    stride_tr,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
):
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_len = tl.load(q_len_ptr + chunk)
    if tile * BLOCK_M >= q_len:
        return
    q_start = tl.load(q_start_ptr + chunk)
    ctx = tl.load(ctx_len_ptr + chunk)
    cached = ctx - q_len
    kvh = head // GROUP
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM_P)
    n = tl.arange(0, BLOCK_N)
    rows_ok = rows < q_len
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=rows_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = cached + rows  # each row's position in its sequence
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    # Keys past the tile's last row are masked for every row: stop there. Every row sees key
    # 0 in the first iteration, so no row's maximum stays -inf.
    end = tl.minimum(ctx, cached + (tile + 1) * BLOCK_M)
    k_head = k_cache_ptr + kvh * stride_ch
    v_head = v_cache_ptr + kvh * stride_ch
    table = tables_ptr + chunk * stride_tr
    for start in range(0, end, BLOCK_N):
        pos = start + n
        valid = pos < ctx
        k, v = _kv_tile(k_head, v_head, table, pos, valid, d, d_ok, stride_cs, BLOCK_SIZE, UPCAST)
        s = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_M, BLOCK_N]
        s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m, denom, acc = _softmax_step(s, v, m, denom, acc)
    out = acc / denom[:, None]
    tl.store(
        out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=rows_ok[:, None] & d_ok[None, :],
    )


def _strides(
    q: torch.Tensor, k_cache: torch.Tensor, tables: torch.Tensor, out: torch.Tensor
) -> tuple[int, ...]:
    """The strides both kernels take, in their order (stride_qt to stride_oh)."""
    return (
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        tables.stride(0),
        out.stride(0),
        out.stride(1),
    )


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new query token per sequence: q [N, H, D] against each sequence's cached context
    (the first context_lens[i] tokens of the blocks tables[i] lists). Rows with a context of
    0 come out as zeros."""
    n, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    if out is None:
        out = torch.empty_like(q)
    if n == 0:
        return out
    tile = block_size * max(1, 32 // block_size)
    _paged_decode_kernel[(n, kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        tables,
        context_lens,
        scale,
        *_strides(q, k_cache, tables, out),
        GROUP=group,
        GROUP_P=_pow2(group),
        HEAD_DIM=head_dim,
        HEAD_DIM_P=_pow2(head_dim),
        BLOCK_SIZE=block_size,
        TILE=max(tile, MIN_DOT),
        UPCAST=INTERPRETED or q.dtype == torch.float32,
    )
    return out


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    context_lens: torch.Tensor,
    max_q_len: int,
    block_size: int,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """Chunks of new tokens, each causal over its sequence's cached context and itself: the
    rows q[q_starts[c] : q_starts[c] + q_lens[c]] of chunk c, whose sequence then holds
    context_lens[c] tokens in the blocks tables[c] lists (the chunk's K/V written already).
    Writes those rows of `out`."""
    chunks = q_lens.shape[0]
    heads, head_dim = q.shape[1], q.shape[2]
    group = heads // k_cache.shape[1]
    block_m = 16 if INTERPRETED else 64
    grid = (chunks, heads, triton.cdiv(max_q_len, block_m))
    _paged_prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        tables,
        q_starts,
        q_lens,
        context_lens,
        scale,
        *_strides(q, k_cache, tables, out),
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_P=_pow2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_m,
        UPCAST=INTERPRETED or q.dtype == torch.float32,
    )
    return out


class TritonPagedAttention(TorchPagedAttention):
    """Paged attention with the Triton kernels for the phases they serve (decode, prefill),
    the torch reference for the others."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        *,
        triton_decode: bool = True,
        triton_prefill: bool = True,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.triton_decode = triton_decode
        self.triton_prefill = triton_prefill
        self.failures: dict[str, str] = {}
        """Phase -> why its kernel could not build or launch (that phase runs on torch)."""

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        if not self.triton_decode:
            super().decode(q, k_cache, v_cache, md, out)
            return
        n = md.num_decodes
        assert md.decode_tables is not None and md.decode_context_lens is not None
        paged_decode(
            q[:n],
            k_cache,
            v_cache,
            md.decode_tables,
            md.decode_context_lens,
            md.block_size,
            self.scale,
            out=out[:n],
        )

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        if not self.triton_prefill:
            super().prefill(q, k, v, k_cache, v_cache, md, out)
            return
        pb = md.prefill_batch
        assert pb is not None
        paged_prefill(
            q,
            k_cache,
            v_cache,
            pb.tables,
            pb.q_starts,
            pb.q_lens,
            pb.context_lens,
            pb.max_q_len,
            md.block_size,
            self.scale,
            out,
        )


Timer = Callable[[Callable[[], object]], float]


def cuda_timer(fn: Callable[[], object], warmup: int = 2, reps: int = 5) -> float:
    """Median seconds of `fn` on the current CUDA stream."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def measured_backend(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_size: int,
    num_blocks: int,
    max_model_len: int,
    max_num_seqs: int,
    timer: Timer = cuda_timer,
) -> TritonPagedAttention:
    """Time the Triton kernels against the reference on a decode batch and a prefill batch of
    this model's shapes and take, per phase, whichever is faster (`timer` measures one call).

    The batches run on the engine's own (still empty) cache, `k_cache`/`v_cache` of one layer
    with `num_blocks` usable blocks: whatever they write there is zeroed before first use.
    """
    device = k_cache.device
    dtype = k_cache.dtype
    gen = torch.Generator(device="cpu").manual_seed(0)
    decodes = min(max_num_seqs, 64)
    decode_ctx = max(1, min(max_model_len, 1024, num_blocks * block_size // decodes))
    chunk = max(1, min(512, max_model_len // 2, num_blocks * block_size // 4))

    width = -(-max_model_len // block_size)

    def table() -> torch.Tensor:
        """Random blocks (reads and writes only need to be realistic, not distinct)."""
        return torch.randint(1, num_blocks + 1, (width,), generator=gen, dtype=torch.long)

    def run(md: AttentionMetadata, impl: TorchPagedAttention, tokens: int) -> Callable[[], None]:
        q = torch.randn(tokens, num_heads, head_dim, generator=gen).to(device, dtype)
        kv = torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(device, dtype)
        return lambda: impl.forward(q, kv, kv, k_cache, v_cache, md)

    decode_md = build_metadata(
        block_size, [(table(), decode_ctx) for _ in range(decodes)], [], device
    )
    # A fresh prompt and a chunk over as much cached context: the two kinds of prefill.
    prefill_md = build_metadata(
        block_size, [], [(table(), 0, chunk), (table(), chunk, chunk)], device
    )
    reference = TorchPagedAttention(num_heads, num_kv_heads, head_dim, scale)
    kernels = TritonPagedAttention(num_heads, num_kv_heads, head_dim, scale)
    decode_kernel = run(decode_md, kernels, decodes)
    prefill_kernel = run(prefill_md, kernels, 2 * chunk)
    failures = {
        phase: failure
        for phase, fn in (("decode", decode_kernel), ("prefill", prefill_kernel))
        if (failure := launch_failure(fn, device)) is not None
    }
    decode_wins = "decode" not in failures and timer(decode_kernel) < timer(
        run(decode_md, reference, decodes)
    )
    prefill_wins = "prefill" not in failures and timer(prefill_kernel) < timer(
        run(prefill_md, reference, 2 * chunk)
    )
    chosen = TritonPagedAttention(
        num_heads,
        num_kv_heads,
        head_dim,
        scale,
        triton_decode=decode_wins,
        triton_prefill=prefill_wins,
    )
    chosen.failures = failures
    return chosen


def launch_failure(fn: Callable[[], object], device: torch.device) -> str | None:
    """Why a first call of a kernel fails, or None. Triton builds its launcher with the
    system's C compiler and the kernel for this GPU at the first call; either can fail (no
    compiler in the image, an unsupported GPU, a driver too old), and the engine must then
    serve on the torch reference instead of crash-looping."""
    try:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as error:  # Triton's build and launch errors share no base class
        return f"{type(error).__name__}: {error}"[:500]
    return None
