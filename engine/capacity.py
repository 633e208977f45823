"""How long a sequence may be and how many KV blocks an engine gets: its context limit, the
pool size from a memory budget, and the check that one whole sequence fits in the pool."""

from __future__ import annotations

from fleetllm.engine import sizing
from fleetllm.engine.config import EngineConfig, ModelConfig


def max_model_len(requested: int | None, cfg: ModelConfig) -> int:
    """The context limit: as requested, at most what the model's positions allow."""
    limit = cfg.max_position_embeddings
    if cfg.sliding_window is not None:
        # The reference attention has no sliding window; within the window it is exact.
        limit = min(limit, cfg.sliding_window)
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(
            f"max_model_len={requested} exceeds the model's limit of {limit} positions"
        )
    return requested


def check_pool(num_blocks: int, block_size: int, max_len: int) -> None:
    """Refuse a pool that cannot hold one sequence of `max_len` tokens."""
    if num_blocks * block_size < max_len:
        raise ValueError(
            f"the KV cache holds {num_blocks * block_size} tokens "
            f"({num_blocks} blocks of {block_size}), fewer than max_model_len="
            f"{max_len}: give it more blocks or lower max_model_len"
        )


def blocks_from_budget(
    free: int, config: EngineConfig, cfg: ModelConfig, max_len: int, dtype_bytes: int
) -> int:
    """KV blocks for `kv_cache_memory_fraction` of `free` bytes of one rank."""
    tp = config.tensor_parallel_size
    per_token = sizing.kv_bytes_per_token(
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads // tp,
        head_dim=cfg.head_dim,
        kv_cache_dtype=config.kv_cache_dtype,
        dtype_bytes=dtype_bytes,
    )
    per_block = config.block_size * per_token
    budget_blocks = int(free * config.kv_cache_memory_fraction) // per_block
    # Never more than every running sequence at full length could use.
    needed = config.max_num_seqs * -(-max_len // config.block_size)
    return max(1, min(budget_blocks, needed))
