"""The engine's KV-cache events: what the block manager records as its prefix cache changes,
in vLLM's shapes, and the `--kv-events-config` it is configured with."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleetllm.block_hash import chain_hashes, root_hash
from fleetllm.engine.block_manager import KVCacheManager
from fleetllm.engine.config import EngineConfig
from fleetllm.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decoder,
    encoder,
    parse_kv_events_config,
)

BS = 4


def compute(kv: KVCacheManager, rid: str, tokens: list[int], salt: str | None = None) -> None:
    cached = kv.find_cached_prefix(rid, tokens, salt)
    assert kv.allocate(rid, len(tokens), cached)
    kv.cache_full_blocks(rid, tokens, len(tokens))


def test_a_new_engine_says_it_holds_nothing_then_each_stored_run_of_blocks() -> None:
    kv = KVCacheManager(8, BS, True, enable_kv_events=True)
    tokens = list(range(10))  # two full blocks, two tokens left over
    compute(kv, "a", tokens)
    cleared, stored = kv.take_events()
    assert isinstance(cleared, AllBlocksCleared)
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == chain_hashes(root_hash(), tokens, BS)
    assert stored.parent_block_hash is None
    assert stored.token_ids == tokens[:8] and stored.block_size == BS
    assert stored.medium == "GPU" and stored.extra_keys is None
    assert kv.take_events() == []
    # The request grows: the next block is stored with its parent.
    tokens += [10, 11]
    kv.allocate("a", len(tokens))
    kv.cache_full_blocks("a", tokens, len(tokens))
    (more,) = kv.take_events()
    assert isinstance(more, BlockStored)
    assert more.parent_block_hash == stored.block_hashes[-1]
    assert more.token_ids == [8, 9, 10, 11]
    # A second request over the same prefix reuses the blocks: nothing new is stored.
    compute(kv, "b", [*tokens[:8], 99])
    assert kv.take_events() == []


def test_a_salted_sequence_marks_its_first_block_as_vllm_does() -> None:
    kv = KVCacheManager(8, BS, True, enable_kv_events=True)
    kv.take_events()
    compute(kv, "a", list(range(9)), salt="tenant-a")
    (stored,) = kv.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == chain_hashes(root_hash("tenant-a"), list(range(9)), BS)
    assert stored.extra_keys == [("tenant-a",), None]


def test_evictions_and_a_cache_reset_are_removals() -> None:
    kv = KVCacheManager(2, BS, True, enable_kv_events=True)
    kv.take_events()
    compute(kv, "a", [1] * 8)
    kv.free("a")
    (stored,) = kv.take_events()
    compute(kv, "b", [2] * 4)  # takes the least recently used free block
    removed, _ = kv.take_events()
    assert isinstance(removed, BlockRemoved) and len(removed.block_hashes) == 1
    assert removed.block_hashes[0] in stored.block_hashes
    kv.free("b")
    kv.reset_prefix_cache()
    (reset,) = kv.take_events()
    assert isinstance(reset, BlockRemoved) and len(reset.block_hashes) == 2
    assert kv.pool.cached_hashes() == set()


def test_no_events_are_kept_when_they_are_off() -> None:
    kv = KVCacheManager(8, BS, True)
    compute(kv, "a", list(range(9)))
    assert kv.take_events() == []


def test_a_batch_round_trips_in_vllm_encoding() -> None:
    kv = KVCacheManager(8, BS, True, enable_kv_events=True)
    compute(kv, "a", list(range(9)), salt="s")
    batch = KVEventBatch(ts=1.5, events=kv.take_events(), data_parallel_rank=0)
    raw = encoder().encode(batch)
    assert decoder().decode(raw) == batch
    # vLLM's layout: the batch an array, each event a map tagged by its class name.
    import msgspec

    ts, events, rank = msgspec.msgpack.decode(raw)
    assert (ts, rank) == (1.5, 0)
    assert [e["type"] for e in events] == ["AllBlocksCleared", "BlockStored"]
    assert {"lora_id", "medium", "lora_name", "extra_keys"} <= set(events[1])


def test_the_flag_takes_vllms_json() -> None:
    config = EngineConfig(
        model="m",
        kv_events_config='{"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv-events", '
        '"buffer_steps": 100, "hwm": 10, "max_queue_size": 5}',
    )
    config.validate()
    assert config.publishes_kv_events
    off = EngineConfig(model="m", kv_events_config='{"enable_kv_cache_events": false}')
    off.validate()
    assert not off.publishes_kv_events
    null = EngineConfig(
        model="m", kv_events_config='{"enable_kv_cache_events": true, "publisher": "null"}'
    )
    null.validate()
    assert not null.publishes_kv_events
    no_cache = EngineConfig(
        model="m",
        enable_prefix_caching=False,
        kv_events_config='{"enable_kv_cache_events": true}',
    )
    with pytest.raises(ValueError, match="prefix caching"):
        no_cache.validate()


@given(
    st.one_of(
        st.text(max_size=40),
        st.dictionaries(
            st.sampled_from(
                ["enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint",
                 "buffer_steps", "hwm", "max_queue_size", "topic", "other"]
            ),
            st.one_of(
                st.none(), st.booleans(), st.integers(-5, 10**7), st.floats(allow_nan=True),
                st.text(max_size=20), st.sampled_from(["tcp://*:1", "ipc:///x", "zmq", "null"]),
            ),
        ).map(json.dumps),
    )
)  # fmt: skip
def test_any_flag_value_is_a_config_or_a_message_naming_the_flag(text: str) -> None:
    try:
        config = parse_kv_events_config(text)
    except ValueError as exc:
        assert "--kv-events-config" in str(exc)
        return
    assert 1 <= config.buffer_steps <= 1_000_000 and config.hwm >= 0
    assert 1 <= config.max_queue_size <= 1_000_000
    for endpoint in (config.endpoint, config.replay_endpoint):
        assert endpoint is None or endpoint.startswith(("tcp://", "ipc://", "inproc://"))
