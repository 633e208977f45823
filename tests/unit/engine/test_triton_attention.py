"""The Triton paged-attention kernels against the torch reference backend: on CUDA when there
is a GPU, else on the CPU under Triton's interpreter (the same kernels, run in numpy; see
tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from fleetllm.engine import triton_attention as ta
from fleetllm.engine.attention import TorchPagedAttention, build_metadata

ON_GPU = torch.cuda.is_available()
assert ON_GPU or ta.INTERPRETED, "tests/conftest.py sets TRITON_INTERPRET=1 without a GPU"
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
TOLERANCE = {torch.float32: 2e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def setup(
    heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
    gen = torch.Generator().manual_seed(seed)
    slots = 40 * block_size
    k_cache = torch.randn(slots, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(slots, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    return k_cache, v_cache, gen


class Tables:
    """Block tables of random, distinct blocks (never the null block 0), padded with 0: no
    two sequences of a step share a block, as in the engine."""

    def __init__(self, gen: torch.Generator, block_size: int, width: int) -> None:
        self.free = (torch.randperm(39, generator=gen) + 1).tolist()
        self.block_size = block_size
        self.width = width

    def __call__(self, tokens: int) -> torch.Tensor:
        n = -(-tokens // self.block_size)
        row = torch.zeros(self.width, dtype=torch.long)
        row[:n] = torch.tensor(self.free[:n])
        del self.free[:n]
        return row


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(8, 2, 32, 4), (6, 6, 24, 16), (4, 1, 16, 8)],
    ids=["gqa4", "mha-odd-dim", "mqa"],
)
def test_kernels_match_the_reference(heads, kv_heads, head_dim, block_size, dtype) -> None:
    """One step mixing decodes, a fresh prompt and chunks over cached context."""
    k_cache, v_cache, gen = setup(heads, kv_heads, head_dim, block_size, dtype, seed=heads)
    table = Tables(gen, block_size, width=64 // block_size + 1)
    decodes = [(table(n), n) for n in (1, 17, 40)]
    prefills = [
        (table(19), 0, 19),  # a fresh prompt
        (table(33), 21, 12),  # a chunk after 21 cached tokens
        (table(9), 8, 1),  # a one-token chunk over cached context
    ]
    md = build_metadata(block_size, decodes, prefills, DEVICE)
    tokens = len(decodes) + sum(q for _, _, q in prefills)
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(DEVICE, dtype)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    scale = head_dim**-0.5
    ref_caches = (k_cache.clone(), v_cache.clone())
    want = TorchPagedAttention(heads, kv_heads, head_dim, scale).forward(q, k, v, *ref_caches, md)
    got = ta.TritonPagedAttention(heads, kv_heads, head_dim, scale).forward(
        q, k, v, k_cache, v_cache, md
    )
    assert torch.equal(k_cache, ref_caches[0]) and torch.equal(v_cache, ref_caches[1])
    assert got.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_a_row_with_no_context_decodes_to_zeros() -> None:
    """Padding rows of a captured decode batch have a context of 0."""
    k_cache, v_cache, gen = setup(4, 2, 16, 4, torch.float32, seed=1)
    tables = torch.stack([Tables(gen, 4, 4)(10), torch.zeros(4, dtype=torch.long)]).to(DEVICE)
    lens = torch.tensor([10, 0], device=DEVICE)
    q = torch.randn(2, 4, 16, generator=gen).to(DEVICE)
    out = ta.paged_decode(q, k_cache, v_cache, tables, lens, 4, 0.25)
    assert torch.isfinite(out).all()
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert out[0].abs().sum() > 0


def test_each_phase_takes_the_faster_implementation() -> None:
    """The measured choice, with a timer that runs each candidate once and reports times in
    the order they are asked for: decode (kernel, reference), prefill (kernel, reference)."""
    k_cache, v_cache, _ = setup(4, 2, 16, 4, torch.float32, seed=2)
    for times, decode, prefill in [
        ([1.0, 2.0, 3.0, 1.0], True, False),
        ([2.0, 1.0, 1.0, 3.0], False, True),
    ]:
        reported = iter(times)

        def timer(fn, reported=reported) -> float:
            fn()
            return next(reported)

        chosen = ta.measured_backend(
            4, 2, 16, 0.25, k_cache, v_cache, block_size=4, num_blocks=39,
            max_model_len=64, max_num_seqs=3, timer=timer,
        )  # fmt: skip
        assert (chosen.triton_decode, chosen.triton_prefill) == (decode, prefill)


def test_a_kernel_that_cannot_build_falls_back_to_the_reference(monkeypatch) -> None:
    """Triton compiles its launcher with the system's C compiler at the first call: without
    one (or on a GPU the kernel cannot run on) that phase serves on the torch reference, its
    reason kept, and only the other phase is timed."""
    k_cache, v_cache, gen = setup(4, 2, 16, 4, torch.float32, seed=3)

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")

    monkeypatch.setattr(ta, "paged_decode", no_compiler)
    timed = []

    def timer(fn) -> float:
        fn()
        timed.append(fn)
        return float(len(timed))  # the kernel (asked first) wins

    chosen = ta.measured_backend(
        4, 2, 16, 0.25, k_cache, v_cache, block_size=4, num_blocks=39,
        max_model_len=64, max_num_seqs=3, timer=timer,
    )  # fmt: skip
    assert (chosen.triton_decode, chosen.triton_prefill) == (False, True)
    assert set(chosen.failures) == {"decode"}
    assert "C compiler" in chosen.failures["decode"]
    assert len(timed) == 2  # prefill's kernel and reference only
    # The chosen backend decodes exactly as the reference does.
    table = Tables(gen, 4, width=17)
    md = build_metadata(4, [(table(n), n) for n in (5, 9)], [], DEVICE)
    q = torch.randn(2, 4, 16, generator=gen).to(DEVICE)
    kv = torch.randn(2, 2, 16, generator=gen).to(DEVICE)
    reference = TorchPagedAttention(4, 2, 16, 0.25)
    expected = reference.forward(q, kv, kv, k_cache.clone(), v_cache.clone(), md)
    assert torch.equal(chosen.forward(q, kv, kv, k_cache.clone(), v_cache.clone(), md), expected)
