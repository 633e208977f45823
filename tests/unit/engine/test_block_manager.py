"""Block pool and per-request block tables: allocation, reference counts, prefix caching."""

from __future__ import annotations

import pytest

from fleetllm.engine.block_manager import BlockPool, KVCacheManager, hash_block

BS = 4


def test_hash_chain_identifies_whole_prefix() -> None:
    a = hash_block(None, [1, 2, 3, 4])
    assert hash_block(None, [1, 2, 3, 4]) == a
    # Same tokens under a different parent are a different block.
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(hash_block(None, [0, 2, 3, 4]), [5, 6, 7, 8])


def test_allocate_and_free_return_usage_to_zero() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    assert kv.allocate("a", 9)  # 3 blocks
    assert kv.usage() == pytest.approx(3 / 8)
    assert len(kv.block_table("a")) == 3
    assert kv.allocate("a", 12)  # still 3 blocks
    assert len(kv.block_table("a")) == 3
    assert kv.allocate("a", 13)
    assert len(kv.block_table("a")) == 4
    kv.free("a")
    assert kv.usage() == 0.0


def test_failed_allocation_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    assert kv.allocate("a", 12)
    assert not kv.allocate("b", 8)
    assert kv.usage() == pytest.approx(3 / 4)
    assert kv.block_table("b") == []


def test_prefix_hit_reuses_blocks_and_keeps_last_token_uncached() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    prompt = list(range(100, 112))  # exactly 3 full blocks
    assert kv.find_cached_prefix("a", prompt) == []
    assert kv.allocate("a", len(prompt))
    kv.cache_full_blocks("a", prompt, len(prompt))
    # Same prompt: only 2 blocks may be reused, the last token must be recomputed.
    hits = kv.find_cached_prefix("b", prompt)
    assert [b.block_id for b in hits] == kv.block_table("a")[:2]
    # A longer prompt sharing the prefix reuses all 3.
    longer = [*prompt, 1, 2]
    hits = kv.find_cached_prefix("c", longer)
    assert [b.block_id for b in hits] == kv.block_table("a")
    assert kv.allocate("c", len(longer), hits)
    assert kv.block_table("c")[:3] == kv.block_table("a")
    assert all(kv.pool.blocks[i].ref_cnt == 2 for i in kv.block_table("a"))


def test_freed_blocks_stay_cached_count_as_free_and_evict_lru() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    p1 = [1] * 8
    assert kv.allocate("a", 8)
    kv.cache_full_blocks("a", p1, 8)
    kv.free("a")
    assert kv.usage() == 0.0  # cached but unreferenced blocks are free
    hits = kv.find_cached_prefix("b", [*p1, 9])
    assert len(hits) == 2
    # Filling the pool with other data evicts the cached blocks.
    assert kv.allocate("x", 16)
    assert kv.find_cached_prefix("c", [*p1, 9]) == []
    kv.free("x")
    kv.free("b")
    kv.free("c")
    assert kv.usage() == 0.0


def test_reusing_a_free_cached_block_counts_against_free_space() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BS, enable_prefix_caching=True)
    p = [7] * 8
    assert kv.allocate("a", 8)
    kv.cache_full_blocks("a", p, 8)
    kv.free("a")
    hits = kv.find_cached_prefix("b", [*p, 1])
    assert len(hits) == 2
    # 2 reclaimed + 2 new > 3 free: refused without side effects.
    assert not kv.allocate("b", 13, hits)
    assert kv.pool.num_free == 3
    assert kv.allocate("b", 9, hits)
    assert kv.usage() == pytest.approx(1.0)


def test_tail_blocks_are_evicted_before_shared_prefix() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    tokens = list(range(16))
    assert kv.allocate("a", 16)
    kv.cache_full_blocks("a", tokens, 16)
    table = kv.block_table("a")
    kv.free("a")
    # One new block evicts the LRU end: the request's last block, not its first.
    assert kv.allocate("b", 1)
    assert kv.block_table("b") == [table[-1]]
    hits = kv.find_cached_prefix("c", [*tokens[:12], 99])
    assert [b.block_id for b in hits] == table[:3]


def test_duplicate_block_content_is_cached_once() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    p = [3] * 4
    for rid in ("a", "b"):
        assert kv.allocate(rid, 4)
        kv.cache_full_blocks(rid, p, 4)
    kv.free("a")
    kv.free("b")
    hits = kv.find_cached_prefix("c", [*p, 1])
    assert len(hits) == 1
    assert kv.usage() == 0.0


def test_pool_rejects_double_release() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.release([block])
    with pytest.raises(AssertionError):
        pool.release([block])


def test_fresh_blocks_are_reported_once_in_id_order() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS, enable_prefix_caching=False)
    assert kv.take_fresh_blocks() == range(1, 1)
    assert kv.allocate("a", 8)
    assert kv.take_fresh_blocks() == range(1, 3)
    assert kv.take_fresh_blocks() == range(3, 3)
    kv.free("a")
    # Reused blocks are not fresh; never-used ones still come first, in id order.
    assert kv.allocate("b", 12)
    assert kv.take_fresh_blocks() == range(3, 6)
    assert kv.allocate("c", 12)
    assert kv.take_fresh_blocks() == range(6, 7)
    assert 0 not in kv.block_table("b") + kv.block_table("c")  # the null block is never given
