"""Block pool and per-request block tables: allocation, reference counts, prefix caching."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from fleetllm.block_hash import hash_block, root_hash
from fleetllm.engine import block_manager
from fleetllm.engine.block_manager import BlockPool, KVCacheManager

BS = 4


def test_hash_chain_identifies_whole_prefix() -> None:
    root = root_hash()
    a = hash_block(root, [1, 2, 3, 4])
    assert hash_block(root, [1, 2, 3, 4]) == a
    assert len(a) == 32  # a SHA-256 digest
    # Same tokens under a different parent are a different block.
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(hash_block(root, [0, 2, 3, 4]), [5, 6, 7, 8])
    # Each salt starts its own chain.
    assert len({root, root_hash("tenant-a"), root_hash("tenant-b")}) == 3
    assert hash_block(root_hash("tenant-a"), [1, 2, 3, 4]) != a


# -- collisions of the former key, hash((parent, tuple(token_ids))) --------------------------


def old_hash_block(parent: object, token_ids: Sequence[int]) -> int:
    """The former block key: Python's tuple hash, 64 bits that a client can steer."""
    return hash((parent, tuple(token_ids)))


_M64 = (1 << 64) - 1
_P1, _P2, _P5 = 11400714785074694791, 14029467366897019727, 2870177450012600261


def _lane_step(acc: int, lane: int) -> int:
    """One round of CPython's tuple hash (xxHash64's, with rotate-left 31)."""
    acc = (acc + lane * _P2) & _M64
    acc = ((acc << 31) | (acc >> 33)) & _M64
    return (acc * _P1) & _M64


def colliding_blocks(prefix: list[int]) -> tuple[list[int], list[int]]:
    """Two token blocks, `prefix` + 2 ids each, with equal tuple hashes: the last lane of the
    second is solved for by inverting the final round (small ints hash to themselves)."""
    acc = _P5
    for t in prefix:
        acc = _lane_step(acc, t)
    x, y = 7, 9
    target = _lane_step(_lane_step(acc, x), y)
    inv_p1, inv_p2 = pow(_P1, -1, 1 << 64), pow(_P2, -1, 1 << 64)
    before = (target * inv_p1) & _M64
    before = ((before >> 31) | (before << 33)) & _M64  # rotate right 31
    for x2 in range(1000, 2000):
        y2 = ((before - _lane_step(acc, x2)) * inv_p2) & _M64
        if y2 < (1 << 61) - 1:  # hash(y2) == y2
            return [*prefix, x, y], [*prefix, x2, y2]
    raise AssertionError("no colliding lane found")


def test_two_different_blocks_collide_under_the_old_key() -> None:
    a, b = colliding_blocks([1, 2])
    assert a != b and len(a) == len(b) == BS
    assert old_hash_block(None, a) == old_hash_block(None, b)
    assert hash_block(root_hash(), a) != hash_block(root_hash(), b)


def test_colliding_prompts_no_longer_share_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = colliding_blocks([1, 2])

    def reuse_after(prompt_a: list[int], prompt_b: list[int]) -> int:
        kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
        assert kv.find_cached_prefix("a", prompt_a) == []
        assert kv.allocate("a", len(prompt_a))
        kv.cache_full_blocks("a", prompt_a, len(prompt_a))
        return len(kv.find_cached_prefix("b", prompt_b))

    # With the old key, b's prompt is served a's KV block: its output would be computed
    # from another request's tokens.
    with monkeypatch.context() as m:
        m.setattr(block_manager, "hash_block", old_hash_block)
        assert reuse_after([*a, 5], [*b, 5]) == 1
    assert reuse_after([*a, 5], [*b, 5]) == 0
    assert reuse_after([*a, 5], [*a, 6]) == 1  # equal blocks are still shared


def test_cache_salt_separates_tenants() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    prompt = list(range(100, 109))  # 2 full blocks and a token
    assert kv.find_cached_prefix("a", prompt, cache_salt="tenant-a") == []
    assert kv.allocate("a", len(prompt))
    kv.cache_full_blocks("a", prompt, len(prompt))
    assert len(kv.find_cached_prefix("same-salt", prompt, cache_salt="tenant-a")) == 2
    assert kv.find_cached_prefix("other-salt", prompt, cache_salt="tenant-b") == []
    assert kv.find_cached_prefix("no-salt", prompt) == []


def test_hashing_work_per_step_does_not_grow_with_length(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decode 2000 tokens: each full block is hashed once and offered to the cache once, so a
    step late in the output does exactly the work of a step early on."""
    from fleetllm.engine.request import Request
    from fleetllm.engine.sampling_params import SamplingParams
    from fleetllm.engine.scheduler import Scheduler

    hashed = 0
    offered = 0
    real_hash, real_cache = block_manager.hash_block, BlockPool.cache

    def counting_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
        nonlocal hashed
        hashed += 1
        return real_hash(parent, token_ids)

    def counting_cache(pool: BlockPool, block: object, block_hash: bytes) -> None:
        nonlocal offered
        offered += 1
        real_cache(pool, block, block_hash)  # type: ignore[arg-type]

    monkeypatch.setattr(block_manager, "hash_block", counting_hash)
    monkeypatch.setattr(BlockPool, "cache", counting_cache)
    kv = KVCacheManager(num_blocks=1024, block_size=BS, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    req = Request("r", None, list(range(10)), SamplingParams(max_tokens=None), frozenset())
    sched.add(req)
    per_step: list[tuple[int, int]] = []
    for _ in range(2000):
        before = (hashed, offered)
        out = sched.schedule()
        sched.on_step_computed(out)
        req.append_token(len(req.all_token_ids) % 100)
        per_step.append((hashed - before[0], offered - before[1]))
    computed_blocks = req.num_computed_tokens // BS
    assert hashed == offered == computed_blocks  # each block once, never again
    early, late = per_step[40:60], per_step[1980:2000]
    assert max(early) == max(late) == (1, 1)
    assert sum(h for h, _ in early) == sum(h for h, _ in late) == 20 // BS


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
