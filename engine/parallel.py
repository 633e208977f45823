"""Tensor parallelism: how a model is split over N ranks, and the collectives that join it.

Megatron-style: q/k/v and gate/up are split by output rows (column-parallel: each rank owns
whole attention heads and a slice of the MLP), o_proj and down_proj by input columns
(row-parallel), each followed by one all-reduce; the embedding and the LM head are split by
vocabulary rows (vocab-parallel), the embedding joined by an all-reduce, the logits gathered on
rank 0, the only rank that samples. Each rank holds only its shard of the weights and of the KV
cache (its KV heads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fleetllm.engine.config import ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its tensor-parallel group; the default is a single rank."""

    rank: int = 0
    size: int = 1
    group: Any = None  # the torch.distributed process group when size > 1

    def split(self, total: int) -> tuple[int, int]:
        """This rank's [start, end) of `total` items split evenly (the caller checked that
        `size` divides `total`)."""
        per = total // self.size
        return self.rank * per, (self.rank + 1) * per

    def vocab_split(self, vocab: int) -> tuple[int, int, int]:
        """(start, end, rows): this rank's vocabulary ids [start, end) and its number of rows.
        Every rank has ceil(vocab / size) rows, so logits gather evenly; the last rank's rows
        past the vocabulary are zero padding, cut off after the gather."""
        rows = -(-vocab // self.size)
        start = min(self.rank * rows, vocab)
        return start, min(start + rows, vocab), rows

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's `x` along the last dimension, on rank 0 (None elsewhere)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """Refuse a tensor-parallel size that does not split the model's heads and MLP evenly."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1:
        return
    sizes = (
        ("attention heads", cfg.num_heads),
        ("KV heads", cfg.num_kv_heads),
        ("intermediate size", cfg.intermediate_size),
    )
    bad = [f"{name} ({value})" for name, value in sizes if value % size]
    if bad:
        valid = [
            n for n in range(2, cfg.num_kv_heads + 1) if all(value % n == 0 for _, value in sizes)
        ]
        hint = (
            f"; sizes that divide them all: {', '.join(map(str, valid))}"
            if valid
            else "; no size above 1 divides them all"
        )
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the model's {' and '.join(bad)}{hint}"
        )
