"""The CPU decode-attention kernel against the torch reference, and its input checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensor_layouts import rows_apart

from fleetllm.engine import cpu_attention
from fleetllm.engine.attention import TorchPagedAttention, build_metadata

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def decode_batch(
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    lens: list[int],
    dtype: torch.dtype,
    seed: int,
):
    """Random caches, distinct blocks per sequence (tables padded with the null block 0, whose
    contents are garbage the kernel must not read), and the query of each sequence."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_seq) + 1
    slots = num_blocks * block_size
    k_cache = torch.randn(slots, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(slots, kv_heads, head_dim, generator=gen).to(dtype)
    k_cache[:block_size] = float("nan")  # the null block: any read of it shows
    v_cache[:block_size] = float("nan")
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    width = max(per_seq) + 2
    decodes = []
    for n, used in zip(lens, per_seq, strict=True):
        row = torch.zeros(width, dtype=torch.long)
        row[:used] = torch.tensor(order[:used])
        del order[:used]
        decodes.append((row, n))
    md = build_metadata(block_size, decodes, [], torch.device("cpu"))
    q = (torch.randn(len(lens), heads, head_dim, generator=gen) * 3).to(dtype)
    return q, k_cache, v_cache, md


def reference(q, k_cache, v_cache, md, heads, kv_heads, head_dim) -> torch.Tensor:
    """The torch backend in float64 on the same inputs (the null block zeroed: the reference
    reads it under its mask)."""
    k, v = k_cache.double(), v_cache.double()
    k[: md.block_size] = 0
    v[: md.block_size] = 0
    out = torch.empty(q.shape, dtype=torch.float64)
    TorchPagedAttention(heads, kv_heads, head_dim, head_dim**-0.5).decode(q.double(), k, v, md, out)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (8, 2, 128, 16), (6, 6, 24, 4), (4, 1, 80, 8), (4, 2, 20, 16)],
    ids=["smollm2", "gqa4-128", "mha-odd-dim", "mqa-80", "dim-not-a-multiple-of-8"],
)
def test_kernel_matches_the_reference(kernel, heads, kv_heads, head_dim, block_size, dtype):
    lens = [1, block_size, block_size + 1, 3 * block_size - 1, 70]
    q, k_cache, v_cache, md = decode_batch(
        heads, kv_heads, head_dim, block_size, lens, dtype, seed=heads
    )
    out = torch.empty_like(q)
    cpu_attention.CpuPagedAttention(heads, kv_heads, head_dim, head_dim**-0.5, kernel).decode(
        q, k_cache, v_cache, md, out
    )
    want = reference(q, k_cache, v_cache, md, heads, kv_heads, head_dim)
    assert torch.isfinite(out).all()
    assert (out.double() - want).abs().max().item() < TOLERANCE[dtype] * want.abs().max().item()


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(1, 200), min_size=1, max_size=12),
    group=st.sampled_from([1, 2, 3, 4]),
    kv_heads=st.integers(1, 3),
    block_size=st.sampled_from([1, 2, 16, 32]),
    head_dim=st.sampled_from([4, 16, 20, 64]),
    row_gap=st.sampled_from([0, 1, 40]),
    seed=st.integers(0, 2**16),
)
def test_any_batch_matches_the_reference(
    kernel, lens, group, kv_heads, block_size, head_dim, row_gap, seed
):
    heads = group * kv_heads
    q, k_cache, v_cache, md = decode_batch(
        heads, kv_heads, head_dim, block_size, lens, torch.float32, seed
    )
    out = torch.empty_like(q)
    q = rows_apart(q, row_gap)
    kernel.paged_decode(
        q, k_cache, v_cache, md.decode_tables, md.decode_context_lens, block_size,
        head_dim**-0.5, out,
    )  # fmt: skip
    want = reference(q, k_cache, v_cache, md, heads, kv_heads, head_dim)
    assert (out.double() - want).abs().max().item() < 1e-4


def test_inputs_that_would_read_outside_the_cache_are_errors(kernel):
    q, k_cache, v_cache, md = decode_batch(4, 2, 16, 4, [5, 9], torch.float32, seed=0)
    tables, lens = md.decode_tables, md.decode_context_lens
    out = torch.empty_like(q)
    num_blocks = k_cache.shape[0] // 4

    def run(**change):
        args = {"q": q, "k": k_cache, "v": v_cache, "tables": tables, "lens": lens, "out": out}
        args.update(change)
        kernel.paged_decode(
            args["q"], args["k"], args["v"], args["tables"], args["lens"], 4, 0.25, args["out"]
        )

    bad_block = tables.clone()
    bad_block[1, 2] = num_blocks
    negative = tables.clone()
    negative[0, 0] = -1
    cases = {
        "block id past the cache": ({"tables": bad_block}, "outside the cache"),
        "negative block id": ({"tables": negative}, "outside the cache"),
        "context longer than its table": (
            {"lens": torch.tensor([5, 4 * tables.shape[1] + 1])},
            "outside its block table",
        ),
        "empty context": ({"lens": torch.tensor([0, 9])}, "outside its block table"),
        "lens of another batch": ({"lens": torch.tensor([5])}, "lens must be"),
        "int32 tables": ({"tables": tables.int()}, "tables must be"),
        "mixed dtypes": ({"q": q.bfloat16(), "out": out.bfloat16()}, "share one dtype"),
        "heads not a multiple of kv heads": (
            {"q": torch.randn(2, 3, 16), "out": torch.empty(2, 3, 16)},
            "multiple of kv_heads",
        ),
        "heads apart": ({"q": torch.randn(2, 16, 4).transpose(1, 2)}, "adjacent heads"),
        "overlapping rows": (
            {"q": torch.randn(100).as_strided((2, 4, 16), (8, 16, 1))},
            "adjacent heads",
        ),
        "partial last block": ({"k": k_cache[:-1], "v": v_cache[:-1]}, "whole blocks"),
        "unsupported dtype": (
            {
                "q": q.double(),
                "k": k_cache.double(),
                "v": v_cache.double(),
                "out": out.double(),
            },
            "supports float32",
        ),
    }
    for name, (change, message) in cases.items():
        with pytest.raises(RuntimeError, match=message):
            run(**change)
        assert name


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(0, 40),
    kv_heads=st.integers(1, 3),
    head_dim=st.sampled_from([4, 20, 64]),
    row_gap=st.sampled_from([0, 7, 64]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_writing_keys_and_values_matches_index_copy(
    kernel, tokens, kv_heads, head_dim, row_gap, dtype, seed
):
    gen = torch.Generator().manual_seed(seed)
    num_slots = 64
    k_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_slots, generator=gen)[:tokens]
    k = rows_apart(torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype), row_gap)
    v = rows_apart(torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype), row_gap)
    want_k = k_cache.index_copy(0, slots, k)
    want_v = v_cache.index_copy(0, slots, v)
    kernel.write_kv_cache(k_cache, v_cache, slots, k, v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_writes_outside_the_cache_or_of_another_shape_are_errors(kernel):
    k_cache = torch.zeros(32, 2, 16)
    v_cache = torch.zeros(32, 2, 16)
    k = torch.randn(3, 2, 16)
    slots = torch.tensor([0, 5, 31])

    def run(**change):
        args = {"kc": k_cache, "vc": v_cache, "slots": slots, "k": k, "v": k.clone()}
        args.update(change)
        kernel.write_kv_cache(args["kc"], args["vc"], args["slots"], args["k"], args["v"])

    cases = {
        "slot past the cache": ({"slots": torch.tensor([0, 5, 32])}, "outside the cache"),
        "negative slot": ({"slots": torch.tensor([-1, 5, 6])}, "outside the cache"),
        "slots of another batch": ({"slots": torch.tensor([0, 5])}, "slots must be"),
        "int32 slots": ({"slots": slots.int()}, "slots must be"),
        "mixed dtypes": ({"k": k.bfloat16()}, "share one dtype"),
        "another head size": ({"k": torch.randn(3, 2, 8), "v": torch.randn(3, 2, 8)}, "as the"),
        "caches of two shapes": ({"vc": torch.zeros(16, 2, 16)}, "K and V caches"),
        "a cache not contiguous": ({"kc": torch.zeros(32, 16, 2).transpose(1, 2)}, "K and V"),
        "heads apart": ({"k": torch.randn(3, 16, 2).transpose(1, 2)}, "adjacent heads"),
    }
    for name, (change, message) in cases.items():
        with pytest.raises(RuntimeError, match=message):
            run(**change)
        assert name
    assert not k_cache.any() and not v_cache.any()  # every refusal before any write
