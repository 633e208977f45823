"""The engine's publisher and the router's feed over real ZeroMQ sockets: the view follows the
engine's block manager, catches up by replay on a late start and after lost messages, sees a
restarted publisher, and the publisher drops (and counts) rather than block."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from fleetllm.engine.block_manager import KVCacheManager
from fleetllm.engine.kv_publisher import KVEventPublisher
from fleetllm.kv_events import KVEventsConfig
from fleetllm.router.block_keys import VllmHasher
from fleetllm.router.kv_feed import FeedSettings, KVFeed
from fleetllm.router.kv_index import BatchSequencer, ReplicaBlocks

FAST = FeedSettings(probe_interval=0.05, stale_after=1.0, replay_timeout=1.0)


def config(tmp: Path, **extra: object) -> KVEventsConfig:
    return KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"ipc://{tmp}/events",
        replay_endpoint=f"ipc://{tmp}/replay",
        **extra,  # type: ignore[arg-type]
    )


@pytest.fixture
def short_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    # ipc:// paths are bounded (about 100 bytes): pytest's tmp paths can be longer.
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kv-") as tmp:
        yield Path(tmp)


def compute(kv: KVCacheManager, rid: str, tokens: list[int]) -> None:
    cached = kv.find_cached_prefix(rid, tokens)
    assert kv.allocate(rid, len(tokens), cached)
    kv.cache_full_blocks(rid, tokens, len(tokens))
    kv.free(rid)


@asynccontextmanager
async def feed(publisher_config: KVEventsConfig) -> AsyncIterator[KVFeed]:
    context = zmq.asyncio.Context()
    assert publisher_config.replay_endpoint is not None
    kv_feed = KVFeed(
        context,
        publisher_config.endpoint,
        publisher_config.replay_endpoint,
        BatchSequencer(ReplicaBlocks(10_000), VllmHasher()),
        FAST,
    )
    task = asyncio.create_task(kv_feed.run())
    try:
        yield kv_feed
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        context.destroy(linger=0)


async def until(predicate: object, what: str, guard_s: float = 20.0) -> None:
    start = time.monotonic()
    while not predicate():  # type: ignore[operator]
        if time.monotonic() - start > guard_s:
            raise AssertionError(f"not reached within the {guard_s}s hang guard: {what}")
        await asyncio.sleep(0.01)


@pytest.mark.asyncio
async def test_the_feed_follows_the_engine_from_a_late_start_and_through_evictions(
    short_tmp: Path,
) -> None:
    cfg = config(short_tmp)
    publisher = KVEventPublisher(cfg)
    kv = KVCacheManager(6, 4, True, enable_kv_events=True)
    try:
        # Published before anyone listens: only the replay can tell.
        compute(kv, "a", list(range(12)))
        publisher.publish(kv.take_events())
        async with feed(cfg) as kv_feed:
            blocks = kv_feed.sequencer.blocks
            await until(lambda: set(blocks.keys) == kv.pool.cached_hashes(), "late start")
            assert kv_feed.fresh(time.monotonic())
            # Live: new prefixes evict the old ones (6 blocks in the pool).
            for i in range(5):
                compute(kv, f"b{i}", [100 + i] * 8)
                publisher.publish(kv.take_events())
            await until(lambda: set(blocks.keys) == kv.pool.cached_hashes(), "evictions")
            assert kv_feed.batches >= 5
            assert blocks.layout is not None and blocks.layout[1] == 4
    finally:
        publisher.close()


@pytest.mark.asyncio
async def test_a_restarted_publisher_is_seen_and_its_cache_replaces_the_old(
    short_tmp: Path,
) -> None:
    cfg = config(short_tmp)
    publisher = KVEventPublisher(cfg)
    kv = KVCacheManager(16, 4, True, enable_kv_events=True)
    async with feed(cfg) as kv_feed:
        blocks = kv_feed.sequencer.blocks
        for i in range(3):
            compute(kv, f"a{i}", [i] * 8)
            publisher.publish(kv.take_events())
        await until(lambda: len(blocks.keys) == 6, "first engine's blocks")
        publisher.close()
        # The same address, a new engine: it holds nothing of the old one's.
        publisher = KVEventPublisher(cfg)
        kv = KVCacheManager(16, 4, True, enable_kv_events=True)
        for i in range(5):
            compute(kv, f"b{i}", [50 + i] * 4)
            publisher.publish(kv.take_events())
        await until(lambda: set(blocks.keys) == kv.pool.cached_hashes(), "second engine")
        assert set(blocks.keys) == kv.pool.cached_hashes() and len(blocks.keys) == 5
        publisher.close()
        # Its checks go unanswered: the view goes stale.
        await until(lambda: not kv_feed.fresh(time.monotonic()), "stale", guard_s=10)
        assert not kv_feed.fresh(time.monotonic())


def test_a_full_queue_drops_and_counts_instead_of_blocking(short_tmp: Path) -> None:
    drops: list[int] = []
    publisher = KVEventPublisher(
        config(short_tmp, max_queue_size=1), on_drop=lambda: drops.append(1)
    )
    # The publisher thread is kept from draining its queue: batches pile up past the bound.
    publisher._running = False
    publisher._thread.join()
    kv = KVCacheManager(64, 4, True, enable_kv_events=True)
    started = time.monotonic()
    for i in range(50):
        compute(kv, f"r{i}", [i] * 4)
        publisher.publish(kv.take_events())
    assert time.monotonic() - started < 30  # hang guard: never waits on the queue
    assert publisher.dropped == len(drops) > 0
    publisher.close()


def test_an_endpoint_that_cannot_be_bound_is_a_clear_error(short_tmp: Path) -> None:
    first = KVEventPublisher(config(short_tmp))
    try:
        with pytest.raises(ValueError, match="kv-events-config"):
            KVEventPublisher(
                KVEventsConfig(
                    enable_kv_cache_events=True,
                    endpoint=f"ipc://{short_tmp}/other",
                    replay_endpoint="tcp://*:not-a-port",
                )
            )
    finally:
        first.close()


def test_replay_answers_from_the_asked_number_then_the_end_marker(short_tmp: Path) -> None:
    cfg = config(short_tmp)
    publisher = KVEventPublisher(cfg)
    kv = KVCacheManager(16, 4, True, enable_kv_events=True)
    for i in range(4):
        compute(kv, f"r{i}", [i] * 4)
        publisher.publish(kv.take_events())
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(cfg.replay_endpoint or "")
    try:
        seqs: list[int] = []
        for _ in range(50):  # the batches reach the buffer through the publisher thread
            dealer.send_multipart((b"", (2).to_bytes(8, "big")))
            seqs = []
            while True:
                assert dealer.poll(5000), "no replay answer"
                frames = dealer.recv_multipart()
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == -1:
                    break
                seqs.append(seq)
            if seqs == [2, 3]:
                break
            time.sleep(0.05)
        assert seqs == [2, 3]
        dealer.send_multipart((b"", b"bad"))  # a malformed request gets the end marker
        assert dealer.poll(5000)
        assert int.from_bytes(dealer.recv_multipart()[2], "big", signed=True) == -1
    finally:
        dealer.close(linger=0)
        context.term()
        publisher.close()


@pytest.mark.asyncio
async def test_an_address_that_cannot_be_used_leaves_the_replica_unknown_not_the_feed_dead() -> (
    None
):
    context = zmq.asyncio.Context()
    settings = FeedSettings(probe_interval=0.05, stale_after=0.2, replay_timeout=0.1)
    sequencer = BatchSequencer(ReplicaBlocks(10), VllmHasher())
    kv_feed = KVFeed(context, "tcp://256.1.1.1:5557", "tcp://256.1.1.1:5558", sequencer, settings)
    task = asyncio.create_task(kv_feed.run())
    try:
        await asyncio.sleep(0.5)
        assert not task.done()  # it keeps trying
        assert not kv_feed.fresh(time.monotonic())
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        context.destroy(linger=0)
