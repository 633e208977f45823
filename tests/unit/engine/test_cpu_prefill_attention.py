"""The CPU prefill-attention kernel against the torch reference, and its input checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensor_layouts import rows_apart

from fleetllm.engine import cpu_attention
from fleetllm.engine.attention import AttentionMetadata, TorchPagedAttention, build_metadata

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def prefill_batch(
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    chunks: list[tuple[int, int]],
    dtype: torch.dtype,
    seed: int,
    decodes: int = 0,
):
    """A step of `decodes` decode rows (left alone here) then one prefill chunk per
    (cached tokens, new tokens) pair: random caches with distinct blocks per sequence, tables
    padded with the null block, and NaN in the null block and in every slot past a context
    (what the kernel must never read)."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-(cached + new) // block_size) for cached, new in chunks]
    num_blocks = sum(per_seq) + 1
    k_cache = torch.full((num_blocks * block_size, kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    width = max(per_seq) + 2
    prefills = []
    for (cached, new), used in zip(chunks, per_seq, strict=True):
        row = torch.zeros(width, dtype=torch.long)
        row[:used] = torch.tensor(order[:used])
        del order[:used]
        slots = (row[:used, None] * block_size + torch.arange(block_size)).view(-1)[: cached + new]
        k_cache[slots] = torch.randn(len(slots), kv_heads, head_dim, generator=gen)
        v_cache[slots] = torch.randn(len(slots), kv_heads, head_dim, generator=gen)
        prefills.append((row, cached, new))
    md = build_metadata(block_size, [], prefills, torch.device("cpu"))
    md = shift_rows(md, decodes)
    rows = decodes + sum(new for _, new in chunks)
    q = (torch.randn(rows, heads, head_dim, generator=gen) * 3).to(dtype)
    return q, k_cache.to(dtype), v_cache.to(dtype), md


def shift_rows(md: AttentionMetadata, rows: int) -> AttentionMetadata:
    """The same chunks after `rows` decode rows of the batch."""
    assert md.prefill_batch is not None
    md.prefill_batch.q_starts += rows
    for chunk in md.prefills:
        chunk.start += rows
    return md


def reference(q, k_cache, v_cache, md, heads, kv_heads, head_dim) -> torch.Tensor:
    """The torch backend in float64 on the same inputs: every chunk over its context read from
    the cache (its new tokens' K/V are there already, as in a step)."""
    k, v = k_cache.double(), v_cache.double()
    fresh = torch.zeros(q.shape[0], kv_heads, head_dim, dtype=torch.float64)
    fresh_v = torch.zeros_like(fresh)
    for chunk in md.prefills:
        rows = slice(chunk.start, chunk.start + chunk.query_len)
        assert md.prefill_batch is not None
        table = md.prefill_batch.tables[md.prefills.index(chunk)]
        slots = (table[:, None] * md.block_size + torch.arange(md.block_size)).view(-1)
        new = slots[chunk.context_len - chunk.query_len : chunk.context_len]
        fresh[rows], fresh_v[rows] = k[new], v[new]
    out = torch.full(q.shape, float("nan"), dtype=torch.float64)
    attn = TorchPagedAttention(heads, kv_heads, head_dim, head_dim**-0.5)
    attn.prefill(q.double(), fresh, fresh_v, k, v, md, out)
    return out


def prefill_rows(md: AttentionMetadata) -> torch.Tensor:
    return torch.cat([torch.arange(c.start, c.start + c.query_len) for c in md.prefills])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (8, 2, 128, 16), (6, 6, 24, 4), (4, 1, 80, 8)],
    ids=["smollm2", "gqa4-128", "mha-odd-dim", "mqa-80"],
)
def test_kernel_matches_the_reference(kernel, heads, kv_heads, head_dim, block_size, dtype):
    # A fresh prompt, chunks after cached context (a prefix hit, a later chunk), a lone token
    # after a long context, and a chunk longer than a work item's tile of positions.
    chunks = [(0, 37), (block_size, 20), (3 * block_size - 1, 1), (0, 1), (45, 70)]
    q, k_cache, v_cache, md = prefill_batch(
        heads, kv_heads, head_dim, block_size, chunks, dtype, seed=heads, decodes=3
    )
    out = torch.full_like(q, 7.0)
    attn = cpu_attention.CpuPagedAttention(heads, kv_heads, head_dim, head_dim**-0.5, kernel)
    attn.prefill(q, torch.empty(0), torch.empty(0), k_cache, v_cache, md, out)
    want = reference(q, k_cache, v_cache, md, heads, kv_heads, head_dim)
    rows = prefill_rows(md)
    assert torch.isfinite(out[rows]).all()
    assert (out[:3] == 7.0).all(), "the decode rows are not the prefill's to write"
    error = (out[rows].double() - want[rows]).abs().max().item()
    assert error < TOLERANCE[dtype] * want[rows].abs().max().item()


@settings(max_examples=40, deadline=None)
@given(
    chunks=st.lists(st.tuples(st.integers(0, 90), st.integers(1, 60)), min_size=1, max_size=6),
    group=st.sampled_from([1, 2, 3, 4]),
    kv_heads=st.integers(1, 3),
    block_size=st.sampled_from([1, 2, 16, 32]),
    decodes=st.integers(0, 3),
    threads=st.sampled_from([1, 2, 3]),
    row_gap=st.sampled_from([0, 1, 40]),
    seed=st.integers(0, 2**16),
)
def test_any_batch_matches_the_reference(
    kernel, chunks, group, kv_heads, block_size, decodes, threads, row_gap, seed
):
    heads, head_dim = group * kv_heads, 16
    q, k_cache, v_cache, md = prefill_batch(
        heads, kv_heads, head_dim, block_size, chunks, torch.float32, seed, decodes
    )
    out = torch.zeros_like(q)
    pb = md.prefill_batch
    assert pb is not None
    q = rows_apart(q, row_gap)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # items are split between threads by cost: any split holds
    try:
        kernel.paged_prefill(
            q, k_cache, v_cache, pb.tables, pb.q_starts, pb.q_lens, pb.context_lens,
            block_size, head_dim**-0.5, out,
        )  # fmt: skip
    finally:
        torch.set_num_threads(before)
    want = reference(q, k_cache, v_cache, md, heads, kv_heads, head_dim)
    rows = prefill_rows(md)
    assert (out[rows].double() - want[rows]).abs().max().item() < 1e-4


def test_inputs_that_would_read_outside_the_cache_or_q_are_errors(kernel):
    q, k_cache, v_cache, md = prefill_batch(4, 2, 16, 4, [(3, 5), (0, 9)], torch.float32, 0)
    pb = md.prefill_batch
    assert pb is not None
    out = torch.empty_like(q)
    num_blocks = k_cache.shape[0] // 4

    def run(**change):
        args = {
            "q": q, "k": k_cache, "v": v_cache, "tables": pb.tables, "starts": pb.q_starts,
            "lens": pb.q_lens, "contexts": pb.context_lens, "out": out,
        }  # fmt: skip
        args.update(change)
        kernel.paged_prefill(
            args["q"], args["k"], args["v"], args["tables"], args["starts"], args["lens"],
            args["contexts"], 4, 0.25, args["out"],
        )  # fmt: skip

    bad_block = pb.tables.clone()
    bad_block[1, 2] = num_blocks
    negative = pb.tables.clone()
    negative[0, 0] = -1
    long = 4 * pb.tables.shape[1] + 1
    cases = {
        "block id past the cache": ({"tables": bad_block}, "outside the cache"),
        "negative block id": ({"tables": negative}, "outside the cache"),
        "context longer than its table": (
            {"contexts": torch.tensor([8, long])},
            "outside its block table",
        ),
        "more query tokens than context": (
            {"lens": torch.tensor([9, 9])},
            "query tokens in a context of 8",
        ),
        "empty chunk": ({"lens": torch.tensor([0, 9])}, "0 query tokens"),
        "rows past q": ({"starts": torch.tensor([0, 6])}, "outside q"),
        "overlapping chunks": ({"starts": torch.tensor([0, 4])}, "over an earlier chunk"),
        "negative start": ({"starts": torch.tensor([-1, 5])}, "outside q"),
        "lens of another batch": ({"lens": torch.tensor([5])}, "q_lens must be"),
        "int32 context lengths": ({"contexts": pb.context_lens.int()}, "context_lens must be"),
        "int32 tables": ({"tables": pb.tables.int()}, "tables must be"),
        "mixed dtypes": ({"q": q.bfloat16(), "out": out.bfloat16()}, "share one dtype"),
        "heads apart": ({"q": torch.randn(14, 16, 4).transpose(1, 2)}, "adjacent heads"),
        "partial last block": ({"k": k_cache[:-1], "v": v_cache[:-1]}, "whole blocks"),
        "unsupported dtype": (
            {"q": q.double(), "k": k_cache.double(), "v": v_cache.double(), "out": out.double()},
            "supports float32",
        ),
    }
    for name, (change, message) in cases.items():
        with pytest.raises(RuntimeError, match=message):
            run(**change)
        assert name
