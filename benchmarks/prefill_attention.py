"""Prefill attention on the CPU: the engine's kernel against the torch reference (SDPA per chunk).

Both run the same step's prefill chunks over the same paged KV cache, in the same process and
on the same threads, with SmolLM2-135M's attention shape (9 query heads over 3 KV heads of 64)
unless told otherwise: a fresh prompt of each length, a chunk after as much cached context
(chunked prefill, a prefix-cache hit), and a step of several such chunks. Prints each case's
median time, its attention FLOP/s (causal: each query against the keys it sees) and the ratio.

    .venv/bin/python benchmarks/prefill_attention.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from types import ModuleType

import torch

from fleetllm.engine import cpu_features, cpu_kernels
from fleetllm.engine.attention import AttentionMetadata, TorchPagedAttention, build_metadata

# (cached tokens, new tokens) per chunk of one step.
CASES: dict[str, list[tuple[int, int]]] = {
    "fresh 64": [(0, 64)],
    "fresh 148": [(0, 148)],
    "fresh 256": [(0, 256)],
    "256 after 256 cached": [(256, 256)],
    "512 after 512 cached": [(512, 512)],
    "step: 3 fresh 148 + 60 after 100": [(0, 148)] * 3 + [(100, 60)],
}


def step(
    chunks: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    block_size = 16
    gen = torch.Generator().manual_seed(0)
    per_seq = [-(-(cached + new) // block_size) for cached, new in chunks]
    slots = (sum(per_seq) + 1) * block_size
    k_cache = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype)
    order = (torch.randperm(sum(per_seq), generator=gen) + 1).tolist()
    prefills = []
    for (cached, new), used in zip(chunks, per_seq, strict=True):
        table = torch.zeros(max(per_seq), dtype=torch.long)
        table[:used] = torch.tensor(order[:used])
        del order[:used]
        prefills.append((table, cached, new))
    md = build_metadata(block_size, [], prefills, torch.device("cpu"))
    rows = sum(new for _, new in chunks)
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    k = torch.randn(rows, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(rows, kv_heads, dim, generator=gen).to(dtype)
    return q, k, v, k_cache, v_cache, md


def median_ms(fn: Callable[[], None], repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def measure(
    kernel: ModuleType, chunks: list[tuple[int, int]], args: argparse.Namespace, dtype: torch.dtype
) -> tuple[float, float]:
    """Median milliseconds of one step's prefill attention: the kernel's, the reference's."""
    scale = args.head_dim**-0.5
    reference = TorchPagedAttention(args.heads, args.kv_heads, args.head_dim, scale)
    q, k, v, k_cache, v_cache, md = step(chunks, args.heads, args.kv_heads, args.head_dim, dtype)
    pb = md.prefill_batch
    assert pb is not None
    out = torch.empty_like(q)
    ours = median_ms(
        lambda: kernel.paged_prefill(
            q, k_cache, v_cache, pb.tables, pb.q_starts, pb.q_lens, pb.context_lens,
            md.block_size, scale, out,
        ),
        args.repeats,
    )  # fmt: skip
    theirs = median_ms(lambda: reference.prefill(q, k, v, k_cache, v_cache, md, out), args.repeats)
    return ours, theirs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], nargs="+",
                    default=["bfloat16", "float32"])  # fmt: skip
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernel = cpu_kernels.load_kernel()
    if kernel is None:
        raise SystemExit("the CPU kernels did not build: see the warning above")
    print(f"cpu flags      : {cpu_features.describe()}; threads {args.threads}")
    print(f"load average   : {os.getloadavg()[0]:.2f}")
    print(f"shape          : {args.heads} heads over {args.kv_heads} KV heads of {args.head_dim}")
    for dtype_name in args.dtype:
        for name, chunks in CASES.items():
            ours, theirs = measure(kernel, chunks, args, getattr(torch, dtype_name))
            flop = sum(new * (cached + (new + 1) / 2) for cached, new in chunks)
            flop *= 4 * args.heads * args.head_dim
            print(
                f"{dtype_name:<9} {name:<34} kernel {ours:7.3f} ms ({flop / ours / 1e6:5.0f} "
                f"GFLOP/s)  reference {theirs:7.3f} ms ({flop / theirs / 1e6:5.0f})  "
                f"reference / kernel {theirs / ours:.2f}x"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
