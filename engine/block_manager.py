"""Paged KV-cache bookkeeping: the block pool, per-request block tables and prefix caching.

Pure Python, no tensors: the model runner owns the cache tensors, this module decides which
blocks each request's tokens live in.

Prefix caching: a full block is cached under its chained key (`fleetllm.block_hash`: the
parent's key and its tokens, from a root that holds the request's `cache_salt` and LoRA
adapter), which the router computes too. Each full block is hashed once, when the request's
tokens first cover it, and registered in the cache once, when it is first fully computed;
per-step work therefore does not grow with a request's length.

Blocks whose reference count drops to zero stay in the cache and sit in a free queue in LRU
order; they are evicted (their hash forgotten) only when an allocation needs them.

With KV events on, every change to the set of cached keys is recorded, in order, as vLLM's
events (`fleetllm.kv_events`): blocks stored, blocks evicted, and a clear at the start (a new
engine holds nothing, whatever a subscriber believed of the one before it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from fleetllm.block_hash import BlockHash, hash_block, root_hash
from fleetllm.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


NULL_BLOCK = 0


class BlockPool:
    """A fixed set of blocks; free blocks are kept in LRU order (oldest first).

    Block ids run from 1 to num_blocks: id 0 is the null block, never handed out, which
    padded attention rows point at. Never-used blocks leave the free queue in id order, so
    the blocks handed out at least once are exactly ids 1..num_touched: the cache tensors
    zero each block on its first use (and the null block up front) instead of initialising
    the whole pool, and masked attention positions only ever read finite values.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks + 1)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks + 1))
        self._cached: dict[BlockHash, int] = {}  # block hash -> block id
        self.num_touched = 0
        self.events: list[KVEvent] | None = None
        """Where changes to the cached keys are recorded, in order (None: not recorded)."""

    @property
    def num_free(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def lookup(self, block_hash: BlockHash) -> Block | None:
        block_id = self._cached.get(block_hash)
        return None if block_id is None else self.blocks[block_id]

    def allocate(self, n: int) -> list[Block]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            self.num_touched = max(self.num_touched, block_id)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                # Evicting the least recently used cached block.
                self._forget(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Sequence[Block]) -> None:
        """Take a reference on cached blocks that a new request reuses."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: Sequence[Block]) -> None:
        """Drop a reference; unreferenced blocks join the free queue's most recent end."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} released twice"
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def cache(self, block: Block, block_hash: BlockHash) -> bool:
        """Register a full block under its hash, unless an equal block is already cached;
        whether it was registered."""
        if block.block_hash is None and block_hash not in self._cached:
            block.block_hash = block_hash
            self._cached[block_hash] = block.block_id
            return True
        return False

    def reset_prefix_cache(self) -> None:
        for block_id in list(self._cached.values()):
            if self.blocks[block_id].ref_cnt == 0:
                self._forget(self.blocks[block_id])

    def cached_hashes(self) -> set[BlockHash]:
        """Every key in the cache now."""
        return set(self._cached)

    def _forget(self, block: Block) -> None:
        assert block.block_hash is not None
        del self._cached[block.block_hash]
        if self.events is not None:
            last = self.events[-1] if self.events else None
            # Evictions in a row travel as one event.
            if isinstance(last, BlockRemoved):
                last.block_hashes.append(block.block_hash)
            else:
                self.events.append(BlockRemoved([block.block_hash], MEDIUM_GPU))
        block.block_hash = None


@dataclass
class _RequestBlocks:
    root: BlockHash = field(default_factory=root_hash)
    cache_salt: str | None = None
    lora_name: str | None = None  # the adapter's, for the KV events
    blocks: list[Block] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)  # the ids of `blocks`
    hashes: list[BlockHash] = field(default_factory=list)  # of the request's full blocks
    num_registered: int = 0  # leading blocks already offered to the prefix cache


class KVCacheManager:
    """Per-request block tables over a `BlockPool`."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        enable_kv_events: bool = False,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        if enable_kv_events:
            self.pool.events = [AllBlocksCleared()]
        self._reported_touched = 0
        self._requests: dict[str, _RequestBlocks] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found cached

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def take_fresh_blocks(self) -> range:
        """Block ids handed out for the first time since the last call."""
        fresh = range(self._reported_touched + 1, self.pool.num_touched + 1)
        self._reported_touched = self.pool.num_touched
        return fresh

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids: a live list, extended in place as the request gains
        blocks (a new list once it is freed and allocated again); callers only read it."""
        return self._requests[request_id].block_ids

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(
        self,
        request_id: str,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        lora_key: bytes | None = None,
        lora_name: str | None = None,
    ) -> list[Block]:
        """Cached blocks covering the longest cached prefix of `token_ids` (among blocks
        cached under the same `cache_salt` and LoRA adapter). A request's first call also
        fixes the root its blocks are cached under.

        The last token is never served from the cache: the model must compute it to produce
        the next token's logits.
        """
        entry = self._requests.get(request_id)
        if entry is None:
            entry = self._requests[request_id] = _RequestBlocks(
                root_hash(cache_salt, lora_key), cache_salt, lora_name
            )
        if not self.enable_prefix_caching:
            return []
        usable = (len(token_ids) - 1) // self.block_size
        self._extend_hashes(entry, token_ids, usable)
        hits: list[Block] = []
        for block_hash in entry.hashes[:usable]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_query_tokens
        self.prefix_hits += num_hit_tokens

    def allocate(
        self, request_id: str, num_tokens: int, cached_prefix: Sequence[Block] = ()
    ) -> bool:
        """Make the request's blocks cover `num_tokens` tokens, first adopting `cached_prefix`
        (a request's first allocation only). Returns False, changing nothing, when the pool
        cannot supply the blocks."""
        entry = self._requests.setdefault(request_id, _RequestBlocks())
        have = len(entry.blocks) + len(cached_prefix)
        need_new = max(0, self.blocks_needed(num_tokens) - have)
        # Reused blocks that sit in the free queue stop being free once taken.
        reclaimed = sum(1 for b in cached_prefix if b.ref_cnt == 0)
        if need_new + reclaimed > self.pool.num_free:
            return False
        if cached_prefix:
            self.pool.touch(cached_prefix)
            entry.blocks.extend(cached_prefix)
        if need_new:
            entry.blocks.extend(self.pool.allocate(need_new))
        entry.block_ids.extend(b.block_id for b in entry.blocks[len(entry.block_ids) :])
        return True

    def cache_full_blocks(
        self, request_id: str, token_ids: Sequence[int], num_computed: int
    ) -> None:
        """Register each block whose tokens have all been computed under its prefix hash,
        starting at the first block not registered yet."""
        if not self.enable_prefix_caching:
            return
        entry = self._requests[request_id]
        full = min(num_computed // self.block_size, len(entry.blocks))
        if full <= entry.num_registered:
            return
        self._extend_hashes(entry, token_ids, full)
        stored_from = None  # the first block of the run of blocks just registered
        for i in range(entry.num_registered, full):
            if self.pool.cache(entry.blocks[i], entry.hashes[i]):
                if stored_from is None:
                    stored_from = i
            elif stored_from is not None:
                self._record_stored(entry, token_ids, stored_from, i)
                stored_from = None
        if stored_from is not None:
            self._record_stored(entry, token_ids, stored_from, full)
        entry.num_registered = full

    def _record_stored(
        self, entry: _RequestBlocks, token_ids: Sequence[int], start: int, end: int
    ) -> None:
        """Blocks start..end of a request just entered the cache (an event, when on)."""
        events = self.pool.events
        if events is None:
            return
        bs = self.block_size
        # vLLM's per-block extra keys: the salt marks a salted sequence's first block.
        salted = start == 0 and entry.cache_salt is not None
        events.append(
            BlockStored(
                block_hashes=entry.hashes[start:end],
                parent_block_hash=entry.hashes[start - 1] if start else None,
                token_ids=list(token_ids[start * bs : end * bs]),
                block_size=bs,
                lora_id=None,
                medium=MEDIUM_GPU,
                lora_name=entry.lora_name,
                extra_keys=[(entry.cache_salt,), *[None] * (end - 1)] if salted else None,
            )
        )

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first."""
        events = self.pool.events
        if not events:
            return []
        self.pool.events = []
        return events

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Release the request's blocks past those `num_tokens` tokens need (the slots of
        rejected draft tokens)."""
        entry = self._requests.get(request_id)
        if entry is None:
            return
        keep = self.blocks_needed(num_tokens)
        if len(entry.blocks) > keep:
            self.pool.release(entry.blocks[keep:][::-1])
            del entry.blocks[keep:]
            del entry.block_ids[keep:]

    def free(self, request_id: str) -> None:
        entry = self._requests.pop(request_id, None)
        if entry is not None:
            # Tail blocks first, so they are evicted before the shared prefix blocks.
            self.pool.release(entry.blocks[::-1])

    def _extend_hashes(
        self, entry: _RequestBlocks, token_ids: Sequence[int], num_blocks: int
    ) -> None:
        """Hash the first `num_blocks` full blocks of `token_ids`, those not hashed yet."""
        bs = self.block_size
        for i in range(len(entry.hashes), num_blocks):
            parent = entry.hashes[i - 1] if i else entry.root
            entry.hashes.append(hash_block(parent, token_ids[i * bs : (i + 1) * bs]))

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
