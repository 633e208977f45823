"""Attention over the paged KV cache.

The model runner flattens one step's tokens into a single batch: decodes (one new token each)
first, then prefill chunks. `AttentionMetadata` describes that batch once per step; every layer
reuses it. `TorchPagedAttention` is the reference backend: it writes the new K/V into their
cache slots, gathers each sequence's context from its blocks and runs SDPA; it runs on any
device. A faster backend overrides its `decode` and/or `prefill` (the Triton kernels of
`triton_attention.py` on CUDA, chosen per phase by measurement: `select_backend`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fleetllm.engine import kv_cache
from fleetllm.engine.kv_cache import KVCache


@dataclass
class PrefillChunk:
    """One sequence's chunk of new tokens with query_len > 1, or a first token."""

    start: int  # offset of the chunk in the flattened batch
    query_len: int
    context_len: int  # tokens in the cache after this step, the chunk included
    # Slots of the whole context, or None when the chunk is the whole context (nothing cached
    # before it), in which case plain causal attention over the fresh K/V is exact and cheaper.
    context_slots: torch.Tensor | None
    mask: torch.Tensor | None  # [query_len, context_len] bool, True = may attend


@dataclass
class PrefillBatch:
    """All prefill chunks of a step as tensors, for kernels that take them in one launch."""

    tables: torch.Tensor  # [num_chunks, max_blocks] block ids, padded with the null block
    q_starts: torch.Tensor  # [num_chunks] first row of each chunk in the batch
    q_lens: torch.Tensor  # [num_chunks]
    context_lens: torch.Tensor  # [num_chunks] tokens in the cache after the step
    max_q_len: int


@dataclass
class AttentionMetadata:
    block_size: int
    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token
    num_decodes: int  # the first num_decodes tokens are decodes
    decode_tables: torch.Tensor | None  # [num_decodes, max_blocks] block ids, padded
    decode_context_lens: torch.Tensor | None  # [num_decodes] tokens in each context
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillChunk]
    prefill_batch: PrefillBatch | None = None


def build_metadata(
    block_size: int,
    decodes: list[tuple[torch.Tensor, int]],
    prefills: list[tuple[torch.Tensor, int, int]],
    device: torch.device,
) -> AttentionMetadata:
    """Describe a step's batch. Block tables are rows of block ids (on the CPU), covering at
    least the step's context and padded with the null block.

    decodes:  (block table, context_len) per decode, in batch order.
    prefills: (block table, num_computed_before, query_len) per chunk, in batch order after the
              decodes.
    """
    slot_mapping: list[torch.Tensor] = []
    decode_tables = decode_lens = decode_mask = None
    if decodes:
        lens = [ctx for _, ctx in decodes]
        max_blocks = -(-max(lens) // block_size)
        # Rows are padded with the null block; every position past a sequence's context is
        # masked, and reads only finite values (zeros or an earlier request's K/V).
        decode_tables = torch.stack([table[:max_blocks] for table, _ in decodes]).to(device)
        decode_lens = torch.tensor(lens, dtype=torch.long, device=device)
        positions = torch.arange(max_blocks * block_size, device=device)
        decode_mask = (positions[None, :] < decode_lens[:, None])[:, None, None, :]
        last = decode_lens - 1
        slot_mapping.append(
            decode_tables.gather(1, (last // block_size)[:, None]).view(-1) * block_size
            + last % block_size
        )
    chunks: list[PrefillChunk] = []
    start = len(decodes)
    prefill_batch = None
    if prefills:
        ctx_lens = [computed + qlen for _, computed, qlen in prefills]
        width = -(-max(ctx_lens) // block_size)
        q_lens = [qlen for _, _, qlen in prefills]
        q_starts = [start + sum(q_lens[:i]) for i in range(len(q_lens))]
        prefill_batch = PrefillBatch(
            tables=torch.stack([table[:width] for table, _, _ in prefills]).to(device),
            q_starts=torch.tensor(q_starts, dtype=torch.long, device=device),
            q_lens=torch.tensor(q_lens, dtype=torch.long, device=device),
            context_lens=torch.tensor(ctx_lens, dtype=torch.long, device=device),
            max_q_len=max(q_lens),
        )
    for table, computed, qlen in prefills:
        ctx = computed + qlen
        table_t = table[: -(-ctx // block_size)].to(device)
        slots = _table_slots(table_t[None, :], block_size)[0, :ctx]
        slot_mapping.append(slots[computed:])
        if computed == 0:
            context_slots = mask = None
        else:
            context_slots = slots
            q_pos = torch.arange(computed, ctx, device=device)[:, None]
            mask = torch.arange(ctx, device=device)[None, :] <= q_pos
        chunks.append(PrefillChunk(start, qlen, ctx, context_slots, mask))
        start += qlen
    return AttentionMetadata(
        block_size=block_size,
        slot_mapping=torch.cat(slot_mapping),
        num_decodes=len(decodes),
        decode_tables=decode_tables,
        decode_context_lens=decode_lens,
        decode_mask=decode_mask,
        prefills=chunks,
        prefill_batch=prefill_batch,
    )


def _table_slots(tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """[rows, blocks] block ids -> [rows, blocks * block_size] slot ids, in token order."""
    offsets = torch.arange(block_size, device=tables.device)
    return (tables[:, :, None] * block_size + offsets).view(tables.shape[0], -1)


class TorchPagedAttention:
    """Reference paged attention with torch ops; runs on any device."""

    reads_whole_blocks = True
    """Whether it reads the slots of a block past a sequence's last token (masked): then each
    block is zeroed on its first use, since NaN garbage times a zero weight is still NaN."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        k_cache: KVCache,  # [num_slots, KVH, D], possibly quantized
        v_cache: KVCache,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        self.write(k, v, k_cache, v_cache, md)
        out = torch.empty_like(q)
        if md.num_decodes:
            self.decode(q, k_cache, v_cache, md, out)
        if md.prefills:
            self.prefill(q, k, v, k_cache, v_cache, md, out)
        return out

    def write(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: KVCache,
        v_cache: KVCache,
        md: AttentionMetadata,
    ) -> None:
        """Store the step's new keys and values in their cache slots."""
        kv_cache.write(k_cache, md.slot_mapping, k)
        kv_cache.write(v_cache, md.slot_mapping, v)

    def decode(
        self,
        q: torch.Tensor,
        k_cache: KVCache,
        v_cache: KVCache,
        md: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        """Rows [0, num_decodes) of `out`: one query each over its sequence's cache."""
        n = md.num_decodes
        assert md.decode_tables is not None
        # Whole blocks at a time: one contiguous copy per block, not per token.
        flat = md.decode_tables.view(-1)
        kd = kv_cache.gather_blocks(k_cache, flat, n, md.block_size, q.dtype)
        vd = kv_cache.gather_blocks(v_cache, flat, n, md.block_size, q.dtype)
        # Each kv head's query heads form its query rows (a decode needs no causal mask):
        # one dense attention per kv head instead of a grouped-query expansion.
        group = self.num_heads // self.num_kv_heads
        o = F.scaled_dot_product_attention(
            q[:n].view(n, self.num_kv_heads, group, self.head_dim),
            kd.transpose(1, 2),
            vd.transpose(1, 2),
            attn_mask=md.decode_mask,
            scale=self.scale,
        )
        out[:n] = o.reshape(n, self.num_heads, self.head_dim)

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
        """The rows of every prefill chunk: causal over its cached context and itself."""
        for chunk in md.prefills:
            rows = slice(chunk.start, chunk.start + chunk.query_len)
            qc = q[rows].transpose(0, 1).unsqueeze(0)
            if chunk.context_slots is None:
                kc, vc = k[rows], v[rows]
            else:
                kc = kv_cache.select_slots(k_cache, chunk.context_slots, q.dtype)
                vc = kv_cache.select_slots(v_cache, chunk.context_slots, q.dtype)
            o = F.scaled_dot_product_attention(
                qc,
                kc.transpose(0, 1).unsqueeze(0),
                vc.transpose(0, 1).unsqueeze(0),
                attn_mask=chunk.mask,
                is_causal=chunk.mask is None,
                scale=self.scale,
                enable_gqa=True,
            )
            out[rows] = o[0].transpose(0, 1)
