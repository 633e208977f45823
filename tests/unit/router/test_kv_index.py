"""The router's view of each replica's KV cache, fed by the engine's own block manager over a
lossy channel: over random workloads (shared prefixes, salts, evictions), engine restarts,
batches lost on the way and batches the publisher dropped, the view equals what the engines
cache whenever the replay buffer still covers the loss, and never claims a block an engine
does not hold."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetllm.engine.block_manager import KVCacheManager
from fleetllm.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encoder,
)
from fleetllm.router.block_keys import VllmHasher
from fleetllm.router.kv_index import (
    BatchSequencer,
    PrefixIndex,
    ReplicaBlocks,
    Resync,
)

BS = 2
ENCODE = encoder().encode
CLOCK = itertools.count()  # batch timestamps: a restarted engine's batches differ


@dataclass
class Engine:
    """One replica: the engine's block manager and a publisher's numbering and replay buffer
    (as engine/kv_publisher.py keeps them)."""

    num_blocks: int
    buffer_steps: int
    kv: KVCacheManager = field(init=False)
    seq: int = 0
    buffer: deque[tuple[int, bytes]] = field(init=False)
    live: dict[str, int] = field(default_factory=dict)
    next_id: int = 0

    def __post_init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self.kv = KVCacheManager(self.num_blocks, BS, True, enable_kv_events=True)
        self.seq = 0
        self.buffer = deque(maxlen=self.buffer_steps)
        self.live.clear()

    def run(self, tokens: list[int], salt: str | None) -> None:
        """A request's prompt, computed whole; it stays running until `finish`."""
        rid = f"r{self.next_id}"
        self.next_id += 1
        cached = self.kv.find_cached_prefix(rid, tokens, salt)
        if not self.kv.allocate(rid, len(tokens), cached):
            self.kv.free(rid)
            return
        self.kv.cache_full_blocks(rid, tokens, len(tokens))
        self.live[rid] = len(tokens)

    def finish(self, index: int) -> None:
        if self.live:
            rid = sorted(self.live)[index % len(self.live)]
            del self.live[rid]
            self.kv.free(rid)

    def publish(self, queue_full: bool) -> tuple[int, bytes] | None:
        """The step's batch, numbered; a full queue drops it (its number is used all the
        same, and no replay has it)."""
        events = self.kv.take_events()
        if not events:
            return None
        seq, self.seq = self.seq, self.seq + 1
        payload = ENCODE(KVEventBatch(ts=float(next(CLOCK)), events=events, data_parallel_rank=0))
        if queue_full:
            return None
        self.buffer.append((seq, payload))
        return seq, payload

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        return [(seq, payload) for seq, payload in self.buffer if seq >= start]


def resync(sequencer: BatchSequencer, engine: Engine, start: int) -> None:
    """Replays until the view is rebuilt, as the feed does."""
    again: Resync | None = Resync(start, "")
    while again is not None:
        again = sequencer.on_replay(again.start, engine.replay(again.start))


def deliver(sequencer: BatchSequencer, engine: Engine, batch: tuple[int, bytes]) -> None:
    request = sequencer.on_live(*batch)
    if request is not None:
        resync(sequencer, engine, request.start)


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("run"),
            st.lists(st.integers(0, 3), min_size=1, max_size=9),
            st.sampled_from([None, "tenant-a"]),
        ),
        st.tuples(st.just("finish"), st.integers(0, 10)),
        st.tuples(st.just("reset")),
        st.tuples(st.just("restart")),
        st.tuples(st.just("check")),
    ),
    max_size=40,
)


def step(engine: Engine, sequencer: BatchSequencer, op: tuple) -> None:
    if op[0] == "run":
        engine.run(list(op[1]), op[2])
    elif op[0] == "finish":
        engine.finish(op[1])
    elif op[0] == "reset":
        engine.kv.reset_prefix_cache()
    elif op[0] == "restart":
        engine.restart()
    else:
        resync(sequencer, engine, sequencer.check_start)  # the feed's periodic check


@settings(max_examples=300, deadline=None)
@given(
    workloads=st.lists(ops, min_size=1, max_size=2),
    lost=st.lists(st.booleans(), max_size=80),
    pool=st.integers(2, 8),
)
def test_the_view_equals_the_engines_cache_when_the_replay_covers_the_losses(
    workloads: list[list[tuple]], lost: list[bool], pool: int
) -> None:
    """Batches lost in transit (and whole restarts) are repaired by replay: after the
    periodic check, each replica's view is exactly its engine's cached keys. Between checks
    the view is never ahead of its engine once the engine's latest batch has come, but for
    a restart whose first batch was lost (vLLM's numbering names no publisher: the check
    tells the new one from the old)."""
    index = PrefixIndex(max_blocks_per_replica=10_000)
    vllm = VllmHasher()
    losses = iter(lost)
    for r, workload in enumerate(workloads):
        engine = Engine(pool, buffer_steps=10_000)
        sequencer = BatchSequencer(index.replica(f"replica-{r}"), vllm)
        resync(sequencer, engine, 0)
        unseen_restart = False
        for op in workload:
            step(engine, sequencer, op)
            unseen_restart = (unseen_restart or op[0] == "restart") and op[0] != "check"
            batch = engine.publish(queue_full=False)
            if batch is not None and not next(losses, False):
                deliver(sequencer, engine, batch)
                if not unseen_restart:
                    assert set(sequencer.blocks.keys) <= engine.kv.pool.cached_hashes()
        resync(sequencer, engine, sequencer.check_start)  # the periodic check
        assert set(sequencer.blocks.keys) == engine.kv.pool.cached_hashes()
        assert sequencer.malformed == 0
        # Salted sequences included, the engine's keys are what the router computes.
        assert sequencer.blocks.mismatch is None


@settings(max_examples=300, deadline=None)
@given(
    workload=ops,
    lost=st.lists(st.booleans(), max_size=60),
    dropped=st.lists(st.booleans(), max_size=60),
    buffer_steps=st.integers(1, 6),
)
def test_the_view_never_claims_what_the_engine_lost(
    workload: list[tuple], lost: list[bool], dropped: list[bool], buffer_steps: int
) -> None:
    """With batches the publisher dropped (a hole no replay fills) and a replay buffer too
    short for the losses, the view misses blocks but never holds one the engine evicted,
    once the check has come. (A dropped batch that no other follows shows no gap: it is
    seen with the engine's next batch.)"""
    engine = Engine(4, buffer_steps)
    sequencer = BatchSequencer(ReplicaBlocks(10_000), VllmHasher())
    resync(sequencer, engine, 0)
    losses, drops = iter(lost), iter(dropped)
    last_dropped = False
    for op in workload:
        step(engine, sequencer, op)
        full = next(drops, False)
        before = engine.seq
        batch = engine.publish(queue_full=full)
        if engine.seq != before:
            last_dropped = full
        if batch is not None and not next(losses, False):
            deliver(sequencer, engine, batch)
    resync(sequencer, engine, sequencer.check_start)
    if not last_dropped:
        assert set(sequencer.blocks.keys) <= engine.kv.pool.cached_hashes()


def test_a_restart_is_seen_even_when_the_new_publisher_has_passed_the_old_number() -> None:
    """A new publisher numbers from 0 again; when its numbers have overtaken the view's, the
    anchor batch it replays has other bytes: the view starts over instead of mixing the two
    engines' histories."""
    engine = Engine(8, 100)
    sequencer = BatchSequencer(ReplicaBlocks(100), VllmHasher())
    resync(sequencer, engine, 0)
    engine.run([1, 2, 3, 4, 5], None)
    deliver(sequencer, engine, engine.publish(False) or (0, b""))
    before = set(sequencer.blocks.keys)
    assert before and before == engine.kv.pool.cached_hashes()
    engine.restart()
    for tokens in ([7, 7, 7], [8, 8, 8], [9, 9, 9]):
        engine.run(tokens, None)
        engine.publish(False)  # published while the router was away
    resync(sequencer, engine, sequencer.check_start)
    assert set(sequencer.blocks.keys) == engine.kv.pool.cached_hashes()
    assert not before & set(sequencer.blocks.keys)


def test_live_batches_apply_in_order_and_ask_for_a_replay_otherwise() -> None:
    sequencer = BatchSequencer(ReplicaBlocks(100), VllmHasher())
    assert sequencer.on_live(0, b"") == Resync(0, "first sync")
    assert sequencer.on_replay(0, []) is None
    batch = ENCODE(KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
    assert sequencer.on_live(0, batch) is None
    assert sequencer.on_live(0, batch) is None  # the same batch twice is applied once
    assert sequencer.on_live(2, batch) == Resync(0, "gap")
    other = ENCODE(KVEventBatch(ts=1.0, events=[AllBlocksCleared()]))
    assert sequencer.on_live(0, other) == Resync(0, "publisher restarted")


def stored(keys: list[bytes | int], tokens: list[int], **extra: object) -> BlockStored:
    return BlockStored(
        block_hashes=keys,
        parent_block_hash=extra.pop("parent", None),  # type: ignore[arg-type]
        token_ids=tokens,
        block_size=BS,
        lora_id=None,
        medium=extra.pop("medium", "GPU"),  # type: ignore[arg-type]
        lora_name=None,
    )


def test_a_replica_hashing_otherwise_is_not_trusted() -> None:
    from fleetllm.block_hash import chain_hashes, root_hash

    vllm = VllmHasher()
    good = ReplicaBlocks(100)
    good.apply(KVEventBatch(0.0, [stored(chain_hashes(root_hash(), [1, 2], BS), [1, 2])]), vllm)
    assert good.mismatch is None and good.layout is not None
    vllm_keys = vllm.chain([1, 2], BS, None, 1)
    good_vllm = ReplicaBlocks(100)
    good_vllm.apply(KVEventBatch(0.0, [stored(list(vllm_keys), [1, 2])]), vllm)
    assert good_vllm.mismatch is None
    seeded = ReplicaBlocks(100)
    other_seed = VllmHasher("1234").chain([1, 2], BS, None, 1)
    seeded.apply(KVEventBatch(0.0, [stored(list(other_seed), [1, 2])]), vllm)
    assert seeded.mismatch is not None and "seed" in seeded.mismatch
    odd = ReplicaBlocks(100)
    odd.apply(KVEventBatch(0.0, [stored([b"short"], [1, 2])]), vllm)
    assert odd.mismatch is not None


def test_offload_tiers_and_bounds() -> None:
    vllm = VllmHasher()
    blocks = ReplicaBlocks(max_blocks=3)
    blocks.apply(KVEventBatch(0.0, [stored([11, 12], [1, 2, 3, 4], parent=10)]), vllm)
    blocks.apply(KVEventBatch(0.0, [stored([21], [5, 6], medium="CPU", parent=12)]), vllm)
    assert list(blocks.keys) == [11, 12]
    blocks.apply(KVEventBatch(0.0, [stored([13, 14], [5, 6, 7, 8], parent=12)]), vllm)
    assert list(blocks.keys) == [12, 13, 14]  # the oldest forgotten past the bound
    assert blocks.matched([12, 13, 99, 14]) == 2
    blocks.apply(KVEventBatch(0.0, [BlockRemoved([13], "GPU")]), vllm)
    assert blocks.matched([12, 13]) == 1


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\x93",
        msgspec.msgpack.encode([0.0, [{"type": "Nope"}], 0]),
        msgspec.msgpack.encode([0.0, [{"type": "BlockRemoved", "block_hashes": ["x"]}], 0]),
        ENCODE(KVEventBatch(0.0, [BlockRemoved([b"x" * 65], "GPU")])),
        ENCODE(KVEventBatch(0.0, [stored([1], [1, 2])]))[:-3],
    ],
)
def test_a_malformed_batch_clears_the_view_and_counts(payload: bytes) -> None:
    sequencer = BatchSequencer(ReplicaBlocks(100), VllmHasher())
    sequencer.on_replay(0, [(0, ENCODE(KVEventBatch(0.0, [stored([5], [1, 2])])))])
    assert list(sequencer.blocks.keys) == [5]
    assert sequencer.on_live(1, payload) is None
    assert not sequencer.blocks.keys and sequencer.malformed == 1
    assert sequencer.next_seq == 2
