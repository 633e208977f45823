"""An engine's stats with only its load set: what the engines faked by tests (a metrics
exposition, a replica under the operator's autoscaler) report."""

from __future__ import annotations

from fleetllm.engine.engine_stats import EngineStats


def load_stats(running: int, waiting: int, kv: float) -> EngineStats:
    """`running` and `waiting` requests and a KV-cache usage of `kv`, every counter at zero."""
    return EngineStats(
        num_running=running,
        num_waiting=waiting,
        kv_cache_usage=kv,
        num_preemptions=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        prompt_tokens=0,
        generation_tokens=0,
        num_kv_blocks=100,
        block_size=16,
    )
