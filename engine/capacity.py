"""How many KV blocks an engine gets from a memory budget (the context limit and the check that
one whole sequence fits are the config's: `ModelConfig.context_limit`, `check_kv_pool`)."""

from __future__ import annotations

from fleetllm.engine import sizing
from fleetllm.engine.config import EngineConfig, ModelConfig


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
